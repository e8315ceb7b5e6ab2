"""Span summaries, their composition, and the split prefill: exact against the unsplit path."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import: Triton kernels run on the CPU

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, naive_recurrent_kda
from k3.ops.kda import prefix as pf


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
    assert pf.choose_splits(1, 8, 1 << 20, 132) == 17 and pf.choose_splits(1, 32, 1 << 20, 132) == 5
    assert pf.choose_splits(8, 32, 1 << 20, 132) == 1 and pf.choose_splits(1, 8, 4096, 132) == 1


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


@pytest.mark.skipif(_triton_kernels() is None, reason="k3.ops.kda.triton (KDA-TRITON's kernels) not present")
@pytest.mark.parametrize("P", [2, 3])
def test_split_triton_interpreter(P, monkeypatch):
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    lens = [200, 3, 130]
    cu = torch.tensor([0, 200, 203, 333])
    q, k, v, g, b, S0 = make(1, 333, 1, 16, 16, N=3)
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        ref = chunk_kda(q, k, v, g, b, **kw)
        monkeypatch.setenv("K3_KDA_SPLITS", str(P))
        out = chunk_kda(q, k, v, g, b, **kw)
        monkeypatch.setenv("K3_KDA_BACKEND", "torch")
        exact = chunk_kda(q, k, v, g, b, **kw)
    assert len(lens) == 3 and rel(ref[0], exact[0]) <= 1e-4
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
