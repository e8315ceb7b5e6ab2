"""Span summaries, their composition, and the split prefill (``prefix.py``, ``triton/split.py``): exact against the
unsplit path and the fp64 token recurrence; the cost model's choices; the forgotten-history bound."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before triton is imported (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.ops.kda import chunk_kda, naive_recurrent_kda  # noqa: E402
from k3.ops.kda import prefix as pf  # noqa: E402
from k3.ops.kda.args import KDAArgs, preprocess  # noqa: E402
from tests.ops.kda_ref import rel  # noqa: E402

CUDA = torch.cuda.is_available()
triton_cpu = pytest.mark.skipif(CUDA, reason="interpreter cases (CPU); the GPU tests below cover the same paths")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)


def make(B, T, H, K, V, dtype=torch.float32, seed=0, N=None, gmax=0.02, bmax=0.3):
    """Mild gates and small β so a state carries across many segments (else every entry state is ~0 and a split
    test could not tell a wrong fold from a right one)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    xs = (r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V), -gmax * u(B, T, H, K),
          bmax * u(B, T, H), r(N or B, H, K, V))
    return [x.to(dtype) if i < 5 else x.to(torch.float64 if dtype == torch.float64 else torch.float32)
            for i, x in enumerate(xs)]


def _plain(q, cu=None, N=None) -> KDAArgs:
    """The KDAArgs of a call without in-kernel activations."""
    return KDAArgs(q.shape[-1] ** -0.5, True, False, False, False, None, cu, N or (q.shape[0] if cu is None
                                                                                  else cu.numel() - 1))


# ---------------------------------------------------------------------------------------------- the algebra


@pytest.mark.parametrize("via", ["summary", "forward"])
def test_summary_is_the_affine_map(via):
    cu = torch.tensor([0, 100, 101, 165, 202])
    q, k, v, g, b, S0 = make(1, 202, 2, 8, 6, dtype=torch.float64, N=4, bmax=0.1)
    if via == "summary":
        M, E = pf.span_summaries("torch", q, k, v, g, b, None, None, _plain(q, cu))
    else:
        M, E = pf._span_summaries_via_forward("torch", q, k, v, g, b, None, None, _plain(q, cu))
    assert M.shape == (4, 2, 8, 8) and E.shape == (4, 2, 8, 6) and M.dtype == torch.float64
    assert M.norm() > 0.1  # the map has not decayed to nothing: the check below tests M, not just E
    for n in range(4):
        s = slice(int(cu[n]), int(cu[n + 1]))
        _, S = naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], b[:, s], initial_state=S0[n:n + 1],
                                   output_final_state=True)
        assert rel(M[n] @ S0[n] + E[n], S[0]) < 1e-12


def test_compose_and_fold():
    q, k, v, g, b, S0 = make(1, 150, 2, 8, 6, dtype=torch.float64, bmax=0.1)
    cu = torch.tensor([0, 70, 150])
    M, E = pf.span_summaries("torch", q, k, v, g, b, None, None, _plain(q, cu))
    Mw, Ew = pf.span_summaries("torch", q, k, v, g, b, None, None, _plain(q))
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
    SMs; measured best on an H200: P = 8) and not where the prep dominates (H=32) or a split cannot amortise."""
    m = pf.SplitCostModel()
    n = (1 << 20) // 64
    assert [pf.choose_splits(1, H, T, 132) for H, T in [(8, 1 << 20), (8, 1 << 17), (32, 1 << 20), (16, 1 << 20),
                                                         (8, 4096)]] == [8, 8, 1, 4, 1]
    # against the overlapped unsplit path (12 windows of the 64-token flow at H = 8, T = 1M) the split still wins
    assert pf.choose_splits(1, 8, 1 << 20, 132, overlap=12) == 8 and pf.choose_splits(1, 32, 1 << 20, 132,
                                                                                      overlap=46) == 1
    # 8 segments: 16 · 8 = 128 state programs in one wave; 9 need a second wave and are predicted slower
    assert m.predict_us(pf.balanced_cut([n], 9), 8, 128, 128) > m.predict_us(pf.balanced_cut([n], 8), 8, 128, 128)
    assert m.predict_us([[n]], 8, 128, 128) == pytest.approx(n * m.state_step_us)
    prep, serial = m.prep_us([n], 8), m.predict_us([[n]], 8, 128, 128)
    side = max(prep, serial) + m.overlap_exposed * min(prep, serial)
    assert m.unsplit_total_us([n], 8, 128, 128, windows=12) == pytest.approx((prep + serial + 11 * side) / 12)
    perfect = pf.SplitCostModel(overlap_exposed=0.0)  # were the overlap perfect, less would pay
    assert perfect.unsplit_total_us([n], 8, 128, 128, windows=12) < m.unsplit_total_us([n], 8, 128, 128, windows=12)
    assert pf._list_schedule_us([2.0] * 5, 2) == 6.0 and pf._list_schedule_us([5.0, 1.0, 1.0, 1.0], 2) == 5.0


def test_auto_rule(monkeypatch):
    """``_auto_splits`` on a (pretended) CUDA device: the model's P for bounded gates on the Triton backend; never
    for the torch backend, unbounded gates, short sequences or full SMs; ``K3_KDA_SPLITS`` forces or disables."""
    pytest.importorskip("triton")
    monkeypatch.setattr("k3.ops.kda.triton.sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    P, model = pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton", lower_bound=-5.0)
    assert P == 8 and model == pf.SplitCostModel()
    assert pf._auto_splits([1 << 20], 32, 128, 128, cuda, "triton", lower_bound=-5.0)[0] == 1
    assert pf._auto_splits([1 << 20] + [100] * 40, 8, 128, 128, cuda, "triton", lower_bound=-5.0)[0] == 1
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton", lower_bound=None)[0] == 1
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "torch", lower_bound=-5.0)[0] == 1
    assert pf._auto_splits([20000], 8, 128, 128, cuda, "triton", lower_bound=-5.0)[0] == 1
    monkeypatch.setenv("K3_KDA_SPLITS", "auto")
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton", lower_bound=-5.0)[0] == 8
    monkeypatch.setenv("K3_KDA_SPLITS", "1")
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton", lower_bound=-5.0) == (1, None)
    monkeypatch.setenv("K3_KDA_SPLITS", "3")
    assert pf._auto_splits([10], 8, 128, 128, torch.device("cpu"), "torch") == (3, None)


@pytest.mark.parametrize("P", [2, 7])
def test_forced_split_matches_unsplit(P, monkeypatch):
    """The torch backend through the split (summaries, fold, one varlen forward): B = 2 dense, and a varlen batch
    with the in-kernel activations and long memory."""
    q, k, v, g, b, S0 = make(2, 480, 2, 8, 6)
    ref = chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)
    lens = [460, 5, 64, 130]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q_b, k_b, v_b, g_b, b_b, S_b = make(1, sum(lens), 2, 8, 6, N=4)
    kw = dict(initial_state=S_b, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
              A_log=torch.zeros(2), dt_bias=torch.full((16,), -6.5))  # g ≈ −0.01: long memory
    ref2 = chunk_kda(q_b * 2, k_b, v_b, g_b, b_b - 1.5, **kw)
    monkeypatch.setenv("K3_KDA_SPLITS", str(P))
    calls = []
    real = pf.split_chunk_kda
    monkeypatch.setattr(pf, "split_chunk_kda", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    with torch.no_grad():
        out = chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)
        out2 = chunk_kda(q_b * 2, k_b, v_b, g_b, b_b - 1.5, **kw)
        cold = chunk_kda(q_b * 2, k_b, v_b, g_b, b_b - 1.5, **{**kw, "initial_state": None})
    assert calls == [P] * 3
    for a, r in ((out, ref), (out2, ref2)):
        assert rel(a[0], r[0]) <= 1e-5 and rel(a[1], r[1]) <= 1e-5
    assert rel(cold[0], ref2[0]) > 1e-2  # the states carry far: a wrong entry state would show


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
    monkeypatch.setattr(pf, "split_chunk_kda", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("split")))
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


# ---------------------------------------------------------------------------------------------- Triton (interpreter)


def _k3_case(lens: list[int], seed: int = 0, D: int = 16, H: int = 2):
    """fp32 inputs and the K3 call's keywords (bounded gate fused, in-kernel norms and β), long-memory gates
    (g ≈ −0.01 per token) so states carry across segments, initial states."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, b, S0 = make(1, sum(lens), H, D, D, N=len(lens), seed=seed)
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=torch.zeros(H),
              dt_bias=torch.full((H * D,), -6.5))
    return (q, k, v, g, b - 1.5), kw


def _fp64_reference(args: tuple, kw: dict):
    """fp64 token recurrence per sequence after the same in-kernel activations."""
    q, k, v, g, b = (x.double() for x in args)
    A, dt = kw["A_log"].double(), kw["dt_bias"].double()
    a = KDAArgs(1.0, True, kw["use_qk_l2norm_in_kernel"], True, True, kw["lower_bound"], None, 1)
    qp, kp, gp, bp = preprocess(q, k, g, b, A, dt, a)
    cu, S0 = kw["cu_seqlens"], kw["initial_state"]
    outs, states = [], []
    for n in range(len(cu) - 1):
        s = slice(int(cu[n]), int(cu[n + 1]))
        o, S = naive_recurrent_kda(qp[:, s], kp[:, s], v[:, s], gp[:, s], bp[:, s],
                                   initial_state=S0[n:n + 1].double(), output_final_state=True)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), torch.cat(states, 0)


def _args(args: tuple, kw: dict) -> KDAArgs:
    from k3.ops.kda.args import kda_args

    q, k, v, g, b = args
    return kda_args(q, k, v, g, b, scale=None, initial_state=kw["initial_state"], output_final_state=True,
                    use_qk_l2norm_in_kernel=kw["use_qk_l2norm_in_kernel"], use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, safe_gate=kw["lower_bound"] is not None,
                    lower_bound=kw["lower_bound"], cu_seqlens=kw["cu_seqlens"], A_log=kw["A_log"],
                    dt_bias=kw["dt_bias"])


def _triton_split(args: tuple, kw: dict, P: int, plan=None, spy_m: list | None = None):
    """The Triton split prefill (explicit plan; even cuts of P segments per piece), no grad; ``spy_m`` collects
    (head, M) of every span row that has an M."""
    from k3.ops.kda.triton import split

    if spy_m is not None:
        real = split.launch_span

        def spy(bufs, SE, Mt, rows, *rest):
            real(bufs, SE, Mt, rows, *rest)
            has_m = rows["row_m"].view(Mt.shape[:2]).bool()
            spy_m.extend((h, Mt[qq, r, h].clone()) for qq, r in has_m.nonzero().tolist() for h in range(Mt.shape[2]))

        split.launch_span = spy
    try:
        with torch.no_grad():
            return split.split_prefill_triton(lambda lens, H: pf.split_plan(lens, P, align=1), *args,
                                              kw["initial_state"], kw["A_log"], kw["dt_bias"], _args(args, kw),
                                              plan or split.SplitPlan())
    finally:
        if spy_m is not None:
            split.launch_span = real


@triton_cpu
def test_split_windows_varlen(nan_empty):
    """Forced 3 segments over windows of 3 chunks (a sequence crossing windows, one shorter than a segment, an
    empty one), initial states: equal to the fp64 recurrence to fp32 rounding."""
    from k3.ops.kda.triton.inference_prep import c16_chunk_bytes
    from k3.ops.kda.triton.split import SplitPlan

    args, kw = _k3_case([150, 20, 0, 50], H=1)
    out = _triton_split(args, kw, 3, SplitPlan(window_bytes=3 * c16_chunk_bytes(1, 16, 16, torch.float32)))
    exact = _fp64_reference(args, kw)
    assert rel(out[0], exact[0]) <= 1e-5 and rel(out[1], exact[1]) <= 1e-5, (rel(out[0], exact[0]), rel(out[1], exact[1]))


@triton_cpu
def test_split_forget_is_exact(nan_empty):
    """``SplitPlan.forget_log2``: where a row's suffix provably scales its history by ≤ 2^−20, its M is stored as 0
    and S_ext runs over the suffix alone — on a head whose gates forget (the benchmark's) some rows do so, on a
    head with long memory none may — and the result still equals the fp64 recurrence to fp32 rounding."""
    from k3.ops.kda.triton.split import SplitPlan

    args, kw = _k3_case([170, 20], seed=3)
    dt = kw["dt_bias"].clone().view(2, -1)
    dt[0] = 0.0  # head 0: the benchmark's gates (each 16-token block's bound ~2^−7 here); head 1 remembers
    kw = {**kw, "dt_bias": dt.flatten()}
    ref = _fp64_reference(args, kw)
    m_rows: list = []
    out = _triton_split(args, kw, 3, SplitPlan(forget_log2=20.0), spy_m=m_rows)
    zero = [(h, bool((m == 0).all())) for h, m in m_rows]
    assert any(z for h, z in zero if h == 0) and not any(z for h, z in zero if h == 1), zero
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5


@triton_cpu
def test_split_forget_detects_a_loose_bound():
    """The comparison above can fail: a bound of 2^−0.05 on long-memory gates drops history that still counts;
    without the in-kernel L2 norm (the bound's premise) the same bound is not applied."""
    from k3.ops.kda.triton.split import SplitPlan

    args, kw = _k3_case([100], H=1)
    for norm, bad in ((True, True), (False, False)):
        kwn = {**kw, "use_qk_l2norm_in_kernel": norm}
        ref = _fp64_reference(args, kwn)
        out = _triton_split(args, kwn, 3, SplitPlan(forget_log2=0.05))
        assert (rel(out[0], ref[0]) > 1e-2) == bad, (norm, rel(out[0], ref[0]))


@triton_cpu
def test_forced_split_unbounded_gate_via_summaries(monkeypatch, nan_empty):
    """An unbounded gate with ``K3_KDA_SPLITS`` on the Triton backend: the summaries pass (``span.py``), the fold and
    one varlen forward from the entry states; equal to the fp64 recurrence to fp32 rounding."""
    args, kw = _k3_case([70, 0], H=1)  # two chunks, an empty sequence
    kw = {**kw, "lower_bound": None, "A_log": torch.full((1,), -4.0)}
    ref = _fp64_reference(args, kw)
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "3")
    with torch.no_grad():
        out = chunk_kda(*args, **kw)
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5


@triton_cpu
def test_fold_rows_matches_fp64(nan_empty):
    """``_fold_rows`` on random maps: two pieces of 3 and 2 segments (rows padded to 3, the padded row's result not
    stored), entry states scattered by the row table; against the fp64 left fold, and slots with no row left as they
    were (NaN-poisoned). K = 16, V = 20 (masked columns)."""
    import triton

    from k3.ops.kda.triton import split

    K, V, bv = 16, 20, 32
    Q, R, H = 2, 3, 2
    gen = torch.Generator().manual_seed(K + V)
    SE = torch.randn(Q, R, H, K, V, generator=gen)
    Mt = torch.eye(K) + 0.3 * torch.randn(Q, R, H, K, K, generator=gen) / K**0.5
    row_dst = torch.tensor([1, 2, 3, 5, -1, -1], dtype=torch.int32)
    ent = torch.full((7, H, K, V), float("nan"))
    se = SE.clone()  # the kernel overwrites its rows
    split._fold_rows[(triton.cdiv(V, bv), Q, H)](se, Mt, ent, row_dst, R, H, K, V, BK=K, BV=bv, BKB=16)
    for qq in range(Q):
        S = SE[qq, 0].double()
        for j in range(R):
            if j:
                S = Mt[qq, j].double() @ S + SE[qq, j].double()
            d = int(row_dst[qq * R + j])
            if d >= 0:
                assert rel(ent[d], S.float()) <= 1e-6, (qq, j)
    assert torch.isnan(ent[[0, 4, 6]]).all()


@triton_cpu
def test_prep_decay_bound():
    """The prep's per-block bound ("DEC", log2) is 16 × the block's largest log2 decay of the gate the kernels apply,
    0 for a block with rows past its sequence's end; the buffer exists only when asked for."""
    from k3.ops.kda.triton import inference_prep as ip
    from k3.ops.kda.triton._common import make_chunk_table

    lens = [37, 64]
    (q, k, v, g, b), kw = _k3_case(lens)
    kw["dt_bias"] = torch.zeros_like(kw["dt_bias"])
    cu = kw["cu_seqlens"].to(torch.int32)
    tab = make_chunk_table(1, sum(lens), cu, q.device)
    assert "DEC" not in ip.alloc_c16_buffers(2, tab.NC, 16, 16, torch.float32, "cpu")
    bufs = ip.alloc_c16_buffers(2, tab.NC, 16, 16, torch.float32, "cpu", decay_bound=True)
    bufs["DEC"].fill_(float("nan"))
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    ip.launch_c16_prep(q, k, v, g, b, kw["A_log"], kw["dt_bias"], bufs, tab, 0, tab.NC, 0.25, -5.0, flags)
    a = KDAArgs(0.25, True, True, True, True, -5.0, None, 1)
    gate = preprocess(q, k, g, b, kw["A_log"], kw["dt_bias"], a)[2][0] / math.log(2)
    want = torch.zeros(2, tab.NC * 4)  # [H, blocks]
    for n, (s0, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for j in range(-(-(e - s0) // 16)):
            rows = gate[s0 + 16 * j:min(s0 + 16 * (j + 1), e)]  # [≤16, H, K]
            want[:, int(tab.chunk_off_cpu[n]) * 4 + j] = rows.amax(dim=(0, 2)) * 16 if rows.shape[0] == 16 else 0.0
    got = bufs["DEC"].flatten(1)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got, want)


def test_split_plan_validated():
    """``SplitPlan.forget_log2`` must be None or a number > 0 and needs the bound's premise (L2 norm, β sigmoid); the
    span pass needs the prep's bounds; the split needs a bounded gate."""
    pytest.importorskip("triton")
    from k3.ops.kda.triton import inference_prep as ip
    from k3.ops.kda.triton import split

    flags = dict(l2norm=True, beta_sigmoid=True)
    for bad in (0, -1.0, True, "128"):
        with pytest.raises(ValueError, match="SplitPlan.forget_log2"):
            split.forget_log2(split.SplitPlan(forget_log2=bad), flags)
    assert split.forget_log2(split.SplitPlan(forget_log2=64), flags) == 64.0
    assert split.forget_log2(split.SplitPlan(), dict(l2norm=True, beta_sigmoid=False)) is None
    bufs = ip.alloc_c16_buffers(1, 1, 16, 16, torch.float32, "cpu")
    rows = {n: torch.zeros(1, dtype=torch.int32) for n in ("row_cs", "row_ce", "row_m")}
    with pytest.raises(ValueError, match="forget_log2"):
        split.launch_span(bufs, None, None, rows, 0, 1, 16, 16, forget_log2=128.0)
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="lower_bound"):
        split.split_prefill_triton(None, q, q, q, q, q[..., 0], None, None, None, _plain(q))


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_k3_case(lens: list[int], dt_bias: torch.Tensor, dtype: torch.dtype, seed: int, K: int = 128,
                 V: int = 128) -> tuple[dict, dict]:
    """GPU inputs (heads = dt_bias.shape[0]) and the K3 call's keywords: a varlen batch with initial states, the
    bounded gate fused with A_log = 0 and the given dt_bias [H, K]."""
    H = dt_bias.shape[0]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    T = sum(lens)
    x = dict(q=r(1, T, H, K).to(dtype), k=r(1, T, H, K).to(dtype), v=r(1, T, H, V).to(dtype),
             g=r(1, T, H, K).to(dtype), beta=r(1, T, H).to(dtype))
    kw = dict(initial_state=r(len(lens), H, K, V), output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, A_log=torch.zeros(H, device="cuda"), dt_bias=dt_bias.flatten())
    return x, kw


def _spy_split(monkeypatch) -> list:
    """Record the cuts the Triton split prefill is called with (so a test knows the one-prep path ran)."""
    import k3.ops.kda.triton as kt

    calls = []
    real = kt.split_prefill
    monkeypatch.setattr(kt, "split_prefill", lambda cut, *a, **kw: calls.append(cut) or real(cut, *a, **kw))
    return calls


@pytest.mark.gpu_quick
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gpu_matches_unsplit(dtype, monkeypatch):
    """GPU, K = V = 128, the K3 call (bf16: the Gluon prep), varlen with initial states and long memory: forced 2,
    3, 7, the automatic rule and forced 3 over many windows with the prep
    overlapped equal unsplit (fp32: 1e-5; bf16 storage: 2e-2)."""
    from k3.ops.kda.triton import split
    from k3.ops.kda.triton.inference_prep import c16_chunk_bytes

    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    H = 4
    # the first sequence just long enough (≥ 2 · 16K tokens) for the automatic rule to consider a split
    x, kw = _gpu_k3_case([33000, 3, 9000, 777], torch.full((H, 128), -6.5, device="cuda"), dtype, seed=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(**x, **kw)
        for P in ("2", "3", "7", "auto"):
            monkeypatch.setenv("K3_KDA_SPLITS", P)
            calls = _spy_split(monkeypatch)
            if P == "auto":
                assert pf.SplitCostModel().best([516, 1, 141, 13], H, 128, 128, 32) > 1
            out = chunk_kda(**x, **kw)
            assert len(calls) == 1 and torch.isfinite(out[0]).all(), P
            assert rel(out[0].float(), ref[0].float()) <= tol and rel(out[1], ref[1]) <= tol, P
        # many small windows with the next window's prep on a side stream: the same result
        b, a = _triton_split_gpu(x, kw, 3, split.SplitPlan(window_bytes=40 * c16_chunk_bytes(H, 128, 128, dtype)))
        assert rel(b.float(), ref[0].float()) <= tol and rel(a, ref[1]) <= tol


def _triton_split_gpu(x: dict, kw: dict, P: int, plan):
    from k3.ops.kda.args import kda_args
    from k3.ops.kda.triton import split

    a = kda_args(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=kw["initial_state"],
                 output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, cu_seqlens=kw["cu_seqlens"],
                 A_log=kw["A_log"], dt_bias=kw["dt_bias"])
    return split.split_prefill_triton(lambda lens, H: pf.split_plan(lens, P, align=1), x["q"], x["k"], x["v"],
                                      x["g"], x["beta"], kw["initial_state"], kw["A_log"], kw["dt_bias"], a, plan)


@pytest.mark.gpu_quick
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gpu_forget(dtype, monkeypatch):
    """GPU, K = V = 128: with the default bound the rows of the heads whose gates forget (the benchmark's) store
    M = 0 while the long-memory heads' do not, and forced splits equal unsplit and the split without the bound."""
    from k3.ops.kda.triton import split

    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    H = 4
    dt = torch.zeros(H, 128, device="cuda")
    dt[2:] = -6.5  # heads 2, 3 remember (g ≈ −0.01 per token); heads 0, 1 forget within a few tokens
    x, kw = _gpu_k3_case([30000, 3, 9000, 777], dt, dtype, seed=1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(**x, **kw)
        for P in (3, 7):
            full = _triton_split_gpu(x, kw, P, split.SplitPlan(forget_log2=None))
            seen = []
            real = split.launch_span

            def spy(bufs, SE, Mt, rows, *rest):
                real(bufs, SE, Mt, rows, *rest)
                has_m = rows["row_m"].view(Mt.shape[:2]).bool()
                seen.extend((h, bool((Mt[q, r, h] == 0).all())) for q, r in has_m.nonzero().tolist()
                            for h in range(Mt.shape[2]))

            monkeypatch.setattr(split, "launch_span", spy)
            out = _triton_split_gpu(x, kw, P, split.SplitPlan())
            monkeypatch.setattr(split, "launch_span", real)
            zero = set(seen)
            assert (0, True) in zero and (1, True) in zero and (2, True) not in zero and (3, True) not in zero, zero
            for a in (ref, full):
                assert rel(out[0].float(), a[0].float()) <= tol and rel(out[1], a[1]) <= tol, P


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("K,V", [(16, 128), (128, 16), (100, 72), (64, 64)])
def test_split_gpu_head_dims_bf16(K, V, monkeypatch):
    """GPU, bf16, head dims other than K = V = 128 (the Triton prep): forced 2, 3 and 7 segments of a varlen batch
    with initial states equal the unsplit call (2e-2: bf16 storage)."""
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    x, kw = _gpu_k3_case([3000, 5, 1700], torch.full((2, K), -6.5, device="cuda"), torch.bfloat16, seed=1, K=K, V=V)
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(**x, **kw)
        for P in ("2", "3", "7"):
            monkeypatch.setenv("K3_KDA_SPLITS", P)
            calls = _spy_split(monkeypatch)
            out = chunk_kda(**x, **kw)
            assert len(calls) == 1 and torch.isfinite(out[0]).all(), P
            assert rel(out[0].float(), ref[0].float()) <= 2e-2 and rel(out[1], ref[1]) <= 2e-2, P
