"""Inference prefill on the Triton kernels (no gradients): the 16-token flow (``inference_prep`` + its Gluon twin,
``inference_state``) and the 64-token flow, in windows of chunk buffers, against the fp64 token recurrence.

CPU: the interpreter (fp32 / fp16) with the flow chosen by ``InferencePlan`` (the automatic choice needs 64
state-pass programs) and one chunk per window. GPU: bf16 at K = V = 128, the Gluon prep against the Triton one,
overlapped windows bitwise, causality, 1M tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.kda.triton import chunk_kda as chunk_kda_triton  # noqa: E402
from k3.ops.kda.triton import inference_prep as ip  # noqa: E402
from k3.ops.kda.triton import inference_prep_gluon as ipg  # noqa: E402
from k3.ops.kda.triton._common import HAVE_GLUON, make_chunk_table  # noqa: E402
from k3.ops.kda.triton.inference import InferencePlan, use_c16  # noqa: E402
from tests.ops.kda_ref import (  # noqa: E402
    CUDA,
    DEV,
    assert_close,
    backend_call,
    cpu_only,
    errors,
    gpu,
    make_inputs,
    on_device,
    public_call,
    rel,
)

pytestmark = pytest.mark.usefixtures("nan_empty")
C16 = InferencePlan(c16_min_programs=0)  # the 16-token flow at any size
ONE_CHUNK_WINDOWS = InferencePlan(window_bytes=1)
K3_FLAGS = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "1")


def _run(plan: InferencePlan, cu=None, gate=True, lb=-5.0):
    return backend_call(chunk_kda_triton, cu, gate=gate, lb=lb, inference=plan)


# ---------------------------------------------------------------------------------------------- CPU (interpreter)


@cpu_only
def test_flow_choice():
    """The 16-token flow for bounded gates from ``c16_min_programs`` state-pass programs (heads × 64-column
    V-blocks), the 64-token flow otherwise."""
    plan = InferencePlan()
    assert use_c16(-5.0, K3_FLAGS, 64, 64, plan) and use_c16(-5.0, K3_FLAGS, 32, 128, plan)
    assert not use_c16(-5.0, K3_FLAGS, 63, 64, plan) and not use_c16(-5.0, K3_FLAGS, 63, 32, plan)
    assert not use_c16(None, dict(K3_FLAGS, exact_diag=True), 1 << 20, 128, plan)
    assert use_c16(-5.0, K3_FLAGS, 1, 16, C16)


@cpu_only
def test_c16_varlen_one_chunk_windows():
    """The 16-token flow, the K3 gate, a varlen batch with initial states (one-token, empty and two-chunk
    sequences), one chunk per window (the states carried between windows), V = 24 padded to 32."""
    cu = [0, 1, 63, 63, 130]
    x = make_inputs(1, 130, 1, 16, 24, N=4)
    assert_close(errors(_run(InferencePlan(window_bytes=1, c16_min_programs=0), cu), x, cu=cu, grad=False), 1e-4)


@cpu_only
def test_c16_precomputed_gate_padded_dims():
    """A precomputed log-decay under safe_gate (the inverse's products at tf32x3: the fp16 splits need the K3
    flags), K = 24, V = 40, an odd length, no initial state."""
    x = make_inputs(1, 37, 1, 24, 40, h0=False, log_decay=True)
    assert_close(errors(_run(C16, gate=False), x, gate=False, grad=False), 1e-4)


@cpu_only
@pytest.mark.parametrize("case", ["gates_at_bound", "no_decay_beta_1_repeated"])
def test_c16_extremes(case):
    """Every decay at the bound (raw gate 30); no decay with β ≈ 1 and one key repeated: the 16×16 block all ones
    below the diagonal, where the product form of the inverse has its largest partial terms."""
    kw = dict(g_const=30.0) if case == "gates_at_bound" else dict(g_const=-30.0, beta_logit=12.0, repeat_keys=True)
    assert_close(errors(_run(C16), make_inputs(1, 40, 1, 16, 16, **kw), grad=False), 1e-4)


@cpu_only
def test_c16_fp16():
    assert_close(errors(_run(C16), make_inputs(1, 40, 1, 32, 32), dtype=torch.float16, grad=False), 2e-3)


@cpu_only
def test_c64_varlen_one_chunk_windows():
    """The 64-token flow (what few heads and unbounded gates take; its prep's exact diagonal blocks are the
    training tests'), varlen, one chunk per window."""
    cu = [0, 70, 71, 130]
    x = make_inputs(1, 130, 1, 16, 16, N=3)
    assert_close(errors(_run(ONE_CHUNK_WINDOWS, cu), x, cu=cu, grad=False), 1e-4)


def _causality(plan: InferencePlan, T: int, H: int, D: int, dtype: torch.dtype, ts: tuple[int, ...]) -> None:
    """Changing the inputs from token t on leaves every output before t bitwise unchanged."""
    x = make_inputs(1, T, H, D, D, seed=7, h0=False)
    run = _run(plan)
    with torch.no_grad():
        o, _ = run(on_device(x, dtype, False))
        for t in ts:
            y = {n: v.clone() for n, v in x.items()}
            gen = torch.Generator().manual_seed(t)
            for n in ("q", "k", "v", "g", "beta"):
                y[n][:, t:] = torch.randn(y[n][:, t:].shape, generator=gen, dtype=torch.float64) * 3
            o2, _ = run(on_device(y, dtype, False))
            assert torch.equal(o2[:, :t], o[:, :t]), f"outputs before t={t} changed"
            assert not torch.equal(o2[:, t:], o[:, t:])


@cpu_only
@pytest.mark.parametrize("plan", [C16, InferencePlan()], ids=["c16", "c64"])
def test_causality_bitwise(plan):
    _causality(plan, 40, 1, 16, torch.float32, (17,))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu_quick
@gpu
@pytest.mark.parametrize("gluon", ["1", "0"])
@pytest.mark.parametrize("T,cu", [(1, None), (63, None), (1000, [0, 1, 100, 100, 613, 1000])])
def test_gpu_c16_bf16(monkeypatch, gluon, T, cu):
    """The public call at H = 32 (the 16-token flow by the automatic choice), with the Gluon prep (where this
    Triton has it) and without."""
    monkeypatch.setenv("K3_KDA_GLUON", gluon)
    x = make_inputs(1, T, 32, 128, 128, N=len(cu) - 1 if cu else 1, seed=T)
    assert_close(errors(public_call(cu), x, dtype=torch.bfloat16, cu=cu, grad=False), 2e-2)


@gpu
@pytest.mark.parametrize("case", ["gates_at_bound", "beta_0", "beta_1_repeated", "no_decay_beta_1_repeated"])
def test_gpu_c16_extremes(case):
    kw = dict(gates_at_bound=dict(g_const=30.0), beta_0=dict(beta_logit=-12.0),
              beta_1_repeated=dict(beta_logit=12.0, repeat_keys=True),
              no_decay_beta_1_repeated=dict(g_const=-30.0, beta_logit=12.0, repeat_keys=True))[case]
    assert_close(errors(public_call(), make_inputs(1, 300, 32, 128, 128, **kw), dtype=torch.bfloat16, grad=False),
                 2e-2)


def _c16_buffers(x: dict, cu: list[int] | None, gluon: bool, monkeypatch) -> dict:
    """One window of the 16-token prep's buffers (NaN-filled first, with the split's decay bounds), bf16 inputs."""
    monkeypatch.setenv("K3_KDA_GLUON", "1" if gluon else "0")
    d = on_device(x, torch.bfloat16, False)
    T, H = d["q"].shape[1], d["q"].shape[2]
    tab = make_chunk_table(1, T, torch.tensor(cu, dtype=torch.int32, device=DEV) if cu else None, d["q"].device)
    bufs = ip.alloc_c16_buffers(H, tab.NC, 128, 128, torch.bfloat16, d["q"].device, decay_bound=True)
    for b in bufs.values():
        b.fill_(float("nan"))
    ip.launch_c16_prep(d["q"], d["k"], d["v"], d["g"], d["beta"], d["A"], d["dt"], bufs, tab, 0, tab.NC,
                       128 ** -0.5, -5.0, K3_FLAGS)
    torch.cuda.synchronize()
    return bufs


@pytest.mark.gpu_quick
@pytest.mark.skipif(not (CUDA and HAVE_GLUON), reason="needs CUDA and Gluon")
@pytest.mark.parametrize("case", ["dense_63", "varlen", "no_decay_beta_1_repeated"])
def test_gpu_gluon_prep_buffers_match_triton_prep(monkeypatch, case):
    """Every buffer the state and span passes read agrees with the Triton prep's (the same algebra in another
    rounding order) and is written everywhere."""
    cu = None
    if case == "varlen":
        x, cu = make_inputs(1, 1000, 3, 128, 128, N=5, seed=3), [0, 1, 100, 100, 613, 1000]
    elif case == "dense_63":
        x = make_inputs(1, 63, 3, 128, 128, seed=63)
    else:
        x = make_inputs(1, 300, 2, 128, 128, g_const=-30.0, beta_logit=12.0, repeat_keys=True)
    ref = _c16_buffers(x, cu, False, monkeypatch)
    got = _c16_buffers(x, cu, True, monkeypatch)
    for name in ref:
        r, o = ref[name], got[name]
        assert not torch.isnan(o).any(), f"{name}: NaN (a part left unwritten)"
        assert rel(o, r) <= 1e-2, f"{name}: relative RMS {rel(o, r):.2e}"


@pytest.mark.gpu_quick
@gpu
@pytest.mark.parametrize("H", [32, 2], ids=["c16", "c64"])
def test_gpu_overlapped_windows_bitwise(H):
    """Several windows (the next window's prep on a side stream, the state pass on a high-priority one, two buffers
    taking turns; a sequence across windows): bitwise the one-window result, twice in a row."""
    x = make_inputs(1, 5000, H, 128, 128, N=3)
    cu = [0, 1500, 1501, 5000]
    o_ref, h_ref = errors_free(_run(InferencePlan(window_bytes=1 << 40), cu), x)
    for _ in range(2):
        o, h = errors_free(_run(InferencePlan(window_bytes=1 << 20), cu), x)
        assert torch.equal(o, o_ref) and torch.equal(h, h_ref)


def errors_free(run, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return run(on_device(x, torch.bfloat16, False))


@gpu
@pytest.mark.parametrize("plan", [InferencePlan(), C16], ids=["c64", "c16"])
def test_gpu_causality_bitwise(plan):
    _causality(plan, 1000, 2, 128, torch.bfloat16, (1, 17, 100, 511, 999))


@gpu
def test_gpu_one_million_tokens_no_nan():
    T, H, K = 1 << 20, 2, 128
    gen = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    d = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K) * 4, beta=r(1, T, H),
             A=torch.zeros(H, device=DEV), dt=torch.zeros(H * K, device=DEV))
    with torch.no_grad():
        o, ht = _run(C16)(d)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all() and o.abs().max() > 0


def test_gluon_prep_takes_only_the_k3_setting():
    """The Gluon prep applies to bf16 CUDA calls at K = V = 128 with the K3 flags only (never on CPU)."""
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    assert not ipg.usable(q, 128, 128, K3_FLAGS, -5.0, "fp16x3")
    assert ip.inv_prec(K3_FLAGS, -5.0) == "fp16x3" and ip.inv_prec(K3_FLAGS, None) == "tf32x3"
    for off in ("l2norm", "use_gate", "beta_sigmoid"):
        assert ip.inv_prec(dict(K3_FLAGS, **{off: False}), -5.0) == "tf32x3"
