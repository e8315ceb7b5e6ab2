"""Backward kernel variants of the Triton chunked KDA (``BwdConfig`` knobs) against the fp64 token recurrence.

Every variant runs through ``chunk_kda_triton`` with autograd under the CPU interpreter (TRITON_INTERPRET=1) and is
checked on the output, the final state and EVERY gradient (q, k, v, g, β, initial state, A_log, dt_bias) by relative
RMS error; ``torch.empty`` is poisoned with NaN (the ``nan_empty`` fixture of tests/conftest.py), so any element a
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
from tests.ops.test_kda_triton import (  # noqa: E402
    check_against_reference,
    make_inputs,
    reference,
    rel,
    run_chunk,
)

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-sized cases (CPU)")
pytestmark = pytest.mark.usefixtures("nan_empty")  # every gradient the kernels must write starts as NaN

# name → BwdConfig overrides. "split": one program per (16-row sub-block, chunk, head), all of K at once for
# K ≤ 64; "split_kslices": the same walking K in 16-column slices (several slices, the L2-norm / β reductions
# across them) and the dG → dg pass in 16-column slices (several dA_log partials per chunk).
VARIANTS = {
    "split": dict(intra_split=True),
    "split_kslices": dict(intra_split=True, intra_split_bk=16, intra_dg_bk=16, intra_split_warps=8),
    # WY backward per (chunk, head, K-block) with the fused intra kernel, and both new paths with several K-blocks
    # (the split kernel with stacked MMA operands)
    "wy_kb": dict(wy_kb=True, intra_split=False),
    "wy_kb_2pass": dict(wy_kb=True, wy_kb_two_pass=True, wy_kb_bk=16, wy_kb_bv=16, intra_split=True),
    "wy_kb_split": dict(wy_kb=True, wy_kb_bk=16, wy_kb_bv=16, intra_split=True, intra_split_bk=16,
                        intra_split_stack=True),
    # the fused WY kernel as two launches (dV' pass, then V' pass), with the split and the fused intra kernel
    "wy_split": dict(wy_split=True, intra_split=True),
    "wy_split_fused_intra": dict(wy_split=True, intra_split=False, wy_bv=16),
    # the WY kernel's dq, dk shares handed over in 16 bits (fp16 under the interpreter; only half inputs use it)
    "half_scratch": dict(wy_kb=True, dqk_scratch_half=True, intra_split=True),
    # A_qk's diagonal through the split intra kernel's products (the pre-session-6 form)
    "diag_in_products": dict(intra_qk_diag_apart=False),
}
# only for the K = V = 128 case (production head size): both new paths, 64-column slices / K-blocks / V-blocks
K128 = {"both_k128": dict(intra_split=True, intra_split_bk=64, wy_kb=True, wy_kb_bk=64, wy_kb_bv=64),
        "split_one_slice_stack_k128": dict(intra_split=True, intra_split_bk=128, intra_split_stack=True,
                                           intra_split_warps=8, intra_split_maxnreg=128),
        "wy_split_k128": dict(wy_split=True, intra_split=True, wy_bv=64),
        "wy_kb_default_k128": dict(wy_kb=True)}  # the default launch: four 32-column K-blocks + the dv/dL program
LAUNCHERS = {"intra_split": "launch_intra_split", "wy_kb": "launch_wy_kb"}


def _count(monkeypatch, launcher: str, calls: list) -> None:
    real = getattr(chunk_bwd, launcher)

    def counted(*a, **kw):
        calls.append(launcher)
        return real(*a, **kw)

    monkeypatch.setattr(chunk_bwd, launcher, counted)


@pytest.fixture
def variant(request, monkeypatch):
    """Apply the variant's knobs and count its launches (the test fails if a switched-on path did not run)."""
    knobs = {**VARIANTS, **K128}[request.param]
    # the variants name their WY path: the fused kernel unless they switch ``wy_kb`` on (the default since session 8)
    monkeypatch.setattr(BwdConfig, "wy_kb", False)
    for name, val in knobs.items():
        monkeypatch.setattr(BwdConfig, name, val)
    calls: list = []
    for knob, launcher in LAUNCHERS.items():
        if knobs.get(knob):
            _count(monkeypatch, launcher, calls)
    passes: list = []  # the WY kernel's launches (3 = fused; 1 then 2 = wy_split)
    real_launch = chunk_bwd._wy_launch
    monkeypatch.setattr(chunk_bwd, "_wy_launch",
                        lambda p, cfg, dtype: passes.append(p) or real_launch(p, cfg, dtype))
    yield request.param
    expected = {LAUNCHERS[n] for n in LAUNCHERS if knobs.get(n)}
    assert set(calls) == expected, f"launched {set(calls)}, expected {expected}"
    if not knobs.get("wy_kb"):
        assert set(passes) == ({1, 2} if knobs.get("wy_split") else {3}), passes


# dA_log is one number, Σ over every (token, channel) of dg_act · ∂g/∂A_log; for some inputs its terms cancel
# ~300-fold (measured in fp64: 334 for the unbounded-gate case below, 319 for the one without in-kernel L2 norm /
# sigmoid, 12 for the default case), so its fp32 relative error is the per-element dg error (~2e-6) times that
# factor: those cases check A_log / dt_bias at 1e-3, everything else at 1e-4.
CASES = [  # (B, T, H, K, V, make_inputs kwargs, check kwargs)
    (1, 1, 1, 32, 32, {}, {}),
    (2, 63, 2, 32, 16, {"h0": False}, {}),
    (1, 100, 1, 32, 32, {}, {}),
    (1, 100, 1, 32, 16, {}, {"lb": None, "tol_params": 1e-3}),  # unbounded softplus gate: exact diagonal blocks
    (1, 100, 1, 32, 16, {"gate": False, "g_override": -5.0}, {"gate": False}),  # every log-decay at the bound
    (1, 100, 1, 32, 16, {"beta_logit": -12.0}, {}),  # β ≈ 6e-6
    # β ≈ 1 with identical keys: dA_log is a sum whose terms cancel ~250-fold (see test_kda_triton): 1e-3 there
    (1, 100, 1, 32, 16, {"beta_logit": 12.0, "repeat_keys": True}, {"tol_params": 1e-3}),
    (1, 100, 2, 32, 16, {}, {"l2": False, "bsig": False, "tol_params": 1e-3}),
]


# every case for the two variants that run every new kernel with several K-slices / K-blocks; the one-slice
# "split" and "wy_kb" (with the fused intra kernel) on the cases that stress different code (time budget)
FULL = [(v, c) for v in ("split_kslices", "wy_kb_split", "wy_split") for c in CASES] + \
    [(v, CASES[i]) for v in ("split", "wy_kb", "wy_kb_2pass", "wy_split_fused_intra") for i in (1, 3, 4)]


@cpu_only
@pytest.mark.parametrize("variant,case", FULL, indirect=["variant"])
def test_bwd_variant_matches_recurrence(variant, case):
    B, T, H, K, V, kw, rkw = case
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
    x = make_inputs(1, 300, 1, 32, 16, N=6)
    check_against_reference(x, 1e-4, cu=cu)


@cpu_only
@pytest.mark.parametrize("variant", list(K128), indirect=True)
def test_bwd_variant_k128(variant):
    """K = V = 128: two 64-column slices in the split intra kernel, two K-blocks × two V-blocks in the WY kernel;
    or all of K in one slice (dq, dk finished in registers) with stacked operands."""
    x = make_inputs(1, 70, 1, 128, 128)
    check_against_reference(x, 1e-4)


@cpu_only
@pytest.mark.parametrize("variant", ["split_kslices", "wy_kb", "half_scratch"], indirect=True)
def test_bwd_variant_fp16_equals_fused(variant, monkeypatch):
    """fp16 inputs: the variant vs the default kernels on the same inputs (both against the fp64 reference too)."""
    x = make_inputs(1, 100, 2, 32, 32, seed=5)
    _, _, g_split, do, dht = run_chunk(x, torch.float16)
    monkeypatch.setattr(BwdConfig, "intra_split", False)
    monkeypatch.setattr(BwdConfig, "wy_kb", False)
    _, _, g_fused, _, _ = run_chunk(x, torch.float16)
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rh = reference(xr, 32 ** -0.5, True, True, True, -5.0, None)
    ((ro * do).sum() + (rh * dht).sum()).backward()
    assert set(g_split) == set(g_fused) == set(xr)
    for n in xr:
        assert rel(g_split[n], g_fused[n]) < 1e-3, n
        assert rel(g_split[n], xr[n].grad) < 2e-2, n


@cpu_only
@pytest.mark.parametrize("wy_kb", [False, True])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]])
def test_bwd_without_saved_vn(monkeypatch, wy_kb, case):
    """``FwdConfig.store_vn = False``: the forward keeps U and the WY backward recomputes V' = U − W S (and dL
    through dX Wᵀ + dY Uᵀ) instead of loading V'."""
    from k3.ops.kda.triton.chunk_fwd import FwdConfig

    monkeypatch.setattr(FwdConfig, "store_vn", False)
    monkeypatch.setattr(BwdConfig, "wy_kb", wy_kb)
    B, T, H, K, V, kw, rkw = case
    check_against_reference(make_inputs(B, T, H, K, V, **kw), 1e-4, **rkw)


def test_training_forward_saves_vn_not_u():
    """The training forward hands V' (not U) to the backward, equal to U − W S from the saved entry states."""
    from k3.ops.kda.triton._common import make_chunk_table
    from k3.ops.kda.triton.chunk_fwd import kda_fwd, prep_all

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_inputs(1, 150, 2, 32, 32, seed=3)
    a = [x[n].to(dev, torch.float32) for n in ("q", "k", "v", "g", "beta", "A", "dt")]
    tab = make_chunk_table(1, 150, None, dev)
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    _, _, saved = kda_fwd(*a, 32 ** -0.5, None, tab, -5.0, flags, True)
    assert "VN" in saved and "U" not in saved
    U = prep_all(*a, 32 ** -0.5, tab, -5.0, flags)["U"]
    vn = U - saved["W"] @ saved["HS"]
    assert rel(saved["VN"], vn) < 1e-5


# ---------------------------------------------------------------------------------------------- GPU (bf16)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_VARIANTS = {  # the launch shapes the sweep times (chunk_bwd.BwdConfig), bf16 at K = V = 128
    "split_bk32_4w": dict(intra_split=True, intra_split_bk=32, intra_split_warps=4),
    "split_bk64_8w": dict(intra_split=True, intra_split_bk=64, intra_split_warps=8),
    "wy_kb": dict(wy_kb=True, wy_kb_bk=64, wy_kb_warps=8, wy_kb_stages=1),  # the K-block launch before session 8
    "wy_kb_default": dict(wy_kb=True),
    "split_bk32_4w_stack": dict(intra_split=True, intra_split_bk=32, intra_split_warps=4, intra_split_stack=True),
    "split_bk128_8w_stack_cap128": dict(intra_split=True, intra_split_bk=128, intra_split_warps=8,
                                        intra_split_stack=True, intra_split_maxnreg=128),
    "both": dict(intra_split=True, intra_split_bk=32, intra_split_warps=4, wy_kb=True),
    "wy_kb_2pass": dict(intra_split=True, wy_kb=True, wy_kb_two_pass=True),
    "wy_split": dict(intra_split=True, wy_split=True),
    "wy_split_cap128": dict(intra_split=True, wy_split=True, wy_split_maxnreg=128),
    "diag_in_products": dict(intra_qk_diag_apart=False, intra_prec_half="bf16x3"),
    "bf16x3": dict(intra_prec_half="bf16x3"),
    "split_bk64_4w_cap128": dict(intra_split_bk=64, intra_split_warps=4),  # the default until session 7
    # the session-8 precision changes one at a time (wy_kb_default has both)
    "half_scratch_only": dict(wy_kb=True, dqk_scratch_half=True, intra_prec_off_half=None),
    "off_bf16_only": dict(wy_kb=True, dqk_scratch_half=False, intra_prec_off_half="bf16"),
}


@gpu
@pytest.mark.parametrize("name", list(GPU_VARIANTS))
@pytest.mark.parametrize("kw,rkw", [({}, {}), ({"gate": False, "g_override": -5.0}, {"gate": False}),
                                    ({"beta_logit": 12.0, "repeat_keys": True}, {}), ({"beta_logit": -12.0}, {})])
def test_gpu_bf16_bwd_variants(monkeypatch, name, kw, rkw):
    monkeypatch.setattr(BwdConfig, "wy_kb", False)  # as in the CPU variants: the fused WY unless switched on
    for knob, val in GPU_VARIANTS[name].items():
        monkeypatch.setattr(BwdConfig, knob, val)
    x = make_inputs(1, 300, 2, 128, 128, **kw)
    check_against_reference(x, 2e-2, dtype=torch.bfloat16, **rkw)


@gpu
@pytest.mark.parametrize("name", list(GPU_VARIANTS))
def test_gpu_bf16_bwd_variants_varlen(monkeypatch, name):
    monkeypatch.setattr(BwdConfig, "wy_kb", False)
    for knob, val in GPU_VARIANTS[name].items():
        monkeypatch.setattr(BwdConfig, knob, val)
    cu = [0, 1, 100, 100, 613, 1000]
    x = make_inputs(1, 1000, 4, 128, 128, N=5)
    check_against_reference(x, 2e-2, dtype=torch.bfloat16, cu=cu)


def test_fp32_tiles_fit_sm90_shared_memory():
    """Kernels whose pipeline stages hold chunk-buffer tiles ask for at most 2 stages with fp32 buffers: 3 stages of
    fp32 tiles exceed an H200 SM's 227 KiB (the WY backward at 3 stages needs 246 KB: a launch failure on the fp32
    path, seen on the device), while bf16 buffers keep the configured depth."""
    from k3.ops.kda.triton.chunk_bwd import BwdConfig, _wy_launch
    from k3.ops.kda.triton.chunk_fwd import state_stages
    from k3.utils import overridden_attrs

    with overridden_attrs(BwdConfig, wy_stages=3, wy_split_stages=3):
        for passes in (1, 2, 3):
            assert _wy_launch(passes, BwdConfig, torch.float32)["num_stages"] == 2
            assert _wy_launch(passes, BwdConfig, torch.bfloat16)["num_stages"] == 3
    assert state_stages(3, torch.float32) == 2 and state_stages(3, torch.float16) == 3
