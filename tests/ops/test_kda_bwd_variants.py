"""Backward kernel variants of the Triton chunked KDA (``BwdConfig`` knobs) against the fp64 token recurrence.

Every variant runs through ``chunk_kda_triton`` with autograd under the CPU interpreter (TRITON_INTERPRET=1) and is
checked on the output, the final state and EVERY gradient (q, k, v, g, β, initial state, A_log, dt_bias) by relative
RMS error; ``torch.empty`` is poisoned with NaN (the ``nan_empty`` fixture of test_kda_triton), so any element a
kernel forgets to write shows up. A counter proves the variant's kernels actually ran.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.kda.triton import chunk_bwd  # noqa: E402
from k3.ops.kda.triton.chunk_bwd import BwdConfig  # noqa: E402
from tests.ops.test_kda_triton import (  # noqa: E402,F401  (nan_empty: autouse fixture, active here too)
    check_against_reference,
    make_inputs,
    nan_empty,
    reference,
    rel,
    run_chunk,
)

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-sized cases (CPU)")

# name → BwdConfig overrides. "split": one program per (16-row sub-block, chunk, head), all of K at once for
# K ≤ 64; "split_kslices": the same walking K in 16-column slices (several slices, the L2-norm / β reductions
# across them) and the dG → dg pass in 16-column slices (several dA_log partials per chunk).
VARIANTS = {
    "split": dict(intra_split=True),
    "split_kslices": dict(intra_split=True, intra_split_bk=16, intra_dg_bk=16, intra_split_warps=8),
}


@pytest.fixture
def variant(request, monkeypatch):
    """Apply the variant's knobs and count the split launches (the test fails if the path did not run)."""
    for name, val in VARIANTS[request.param].items():
        monkeypatch.setattr(BwdConfig, name, val)
    calls = []
    real = chunk_bwd.launch_intra_split

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(chunk_bwd, "launch_intra_split", counted)
    yield request.param
    assert calls, "the split intra backward did not run"


CASES = [  # (B, T, H, K, V, make_inputs kwargs, check kwargs)
    (1, 1, 1, 32, 32, {}, {}),
    (2, 63, 2, 32, 16, {"h0": False}, {}),
    (1, 100, 1, 32, 32, {}, {}),
    (1, 100, 1, 32, 16, {}, {"lb": None}),  # unbounded softplus gate: exact diagonal blocks
    (1, 100, 1, 32, 16, {"gate": False, "g_override": -5.0}, {"gate": False}),  # every log-decay at the bound
    (1, 100, 1, 32, 16, {"beta_logit": -12.0}, {}),  # β ≈ 6e-6
    # β ≈ 1 with identical keys: dA_log is a sum whose terms cancel ~250-fold (see test_kda_triton): 1e-3 there
    (1, 100, 1, 32, 16, {"beta_logit": 12.0, "repeat_keys": True}, {"tol_params": 1e-3}),
    (1, 100, 2, 32, 16, {}, {"l2": False, "bsig": False}),
]


@cpu_only
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
@pytest.mark.parametrize("B,T,H,K,V,kw,rkw", CASES)
def test_bwd_variant_matches_recurrence(variant, B, T, H, K, V, kw, rkw):
    x = make_inputs(B, T, H, K, V, **kw)
    if not rkw.get("bsig", True):
        x["beta"] = x["beta"].sigmoid()
        x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    check_against_reference(x, 1e-4, **rkw)


@cpu_only
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_bwd_variant_varlen_odd_lengths(variant):
    """Packed batch with an empty and a one-token sequence, chunks ending mid-sub-block, T = 300 in all."""
    cu = [0, 1, 64, 64, 130, 219, 300]
    x = make_inputs(1, 300, 2, 32, 16, N=6)
    check_against_reference(x, 1e-4, cu=cu)


@cpu_only
@pytest.mark.parametrize("variant", ["split"], indirect=True)
def test_bwd_variant_k128(variant, monkeypatch):
    """K = V = 128 (the production head size), two 64-column slices."""
    monkeypatch.setattr(BwdConfig, "intra_split_bk", 64)
    x = make_inputs(1, 70, 1, 128, 128)
    check_against_reference(x, 1e-4)


@cpu_only
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
def test_bwd_variant_fp16_equals_fused(variant, monkeypatch):
    """fp16 inputs: the split path vs the fused kernel on the same inputs (both against the fp64 reference too)."""
    x = make_inputs(1, 100, 2, 32, 32, seed=5)
    _, _, g_split, do, dht = run_chunk(x, torch.float16)
    monkeypatch.setattr(BwdConfig, "intra_split", False)
    _, _, g_fused, _, _ = run_chunk(x, torch.float16)
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rh = reference(xr, 32 ** -0.5, True, True, True, -5.0, None)
    ((ro * do).sum() + (rh * dht).sum()).backward()
    assert set(g_split) == set(g_fused) == set(xr)
    for n in xr:
        assert rel(g_split[n], g_fused[n]) < 1e-3, n
        assert rel(g_split[n], xr[n].grad) < 2e-2, n
