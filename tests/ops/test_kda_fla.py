"""fla 0.6.0's arguments of ``chunk_kda`` / ``fused_recurrent_kda`` (and fla's exported names) against the fp64
token recurrence: ``allow_neg_eigval``, ``state_v_first`` (and the legacy ``transpose_state_layout``),
``return_intermediate_states``, ``chunk_size``, ``disable_recompute``, ``cu_seqlens_cpu``, ``use_graph`` /
``max_num_seqs``; fla's positional order and exception types.

CPU: the PyTorch backend (fp64) and the Triton kernels in the interpreter (fp32) at the smallest shapes that cover
two chunks, K ≠ V and varlen with an empty sequence. GPU: the same calls in bf16 (skipped without CUDA).
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import k3.ops  # noqa: E402
from k3.ops.kda import (  # noqa: E402
    chunk_kda,
    fused_kda_gate,
    fused_recurrent_kda,
    naive_chunk_kda,
    naive_recurrent_kda,
)
from tests.ops.kda_ref import (  # noqa: E402
    DEV,
    activations,
    assert_close,
    cpu_only,
    errors,
    gpu,
    make_inputs,
    on_device,
    public_call,
    reference,
    rel,
)

pytestmark = pytest.mark.usefixtures("nan_empty")

# fla 0.6.0's positional parameters, in order (fla takes the rest through **kwargs: A_log, dt_bias, chunk_size,
# transpose_state_layout; k3 takes them by keyword)
FLA_CHUNK = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
             "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
             "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
             "cp_context", "use_graph", "max_num_seqs"]
FLA_RECURRENT = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                 "lower_bound", "state_v_first", "cu_seqlens"]


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("K3_KDA_BACKEND", request.param)
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)
    return request.param


def _dtype(backend: str) -> torch.dtype:
    return torch.float32  # fp32 inputs (the helpers keep states and gate parameters in fp32)


def _tol(backend: str) -> float:
    return 1e-5 if backend == "torch" else 1e-4


def _positional(fn) -> list[str]:
    return [n for n, p in inspect.signature(fn).parameters.items()
            if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]


def test_fla_positional_order_and_names():
    assert _positional(chunk_kda) == FLA_CHUNK
    assert _positional(fused_recurrent_kda) == FLA_RECURRENT
    for name in ("chunk_kda", "fused_recurrent_kda", "fused_kda_gate", "naive_chunk_kda", "naive_recurrent_kda"):
        assert getattr(k3.ops, name) is getattr(k3.ops.kda, name)


def _call(fn, d: dict, cu=None, **kw):
    """fla-style keyword call on device inputs (raw gate, β logits, L2 norm in the kernel)."""
    cus = None if cu is None else torch.tensor(cu, device=DEV)
    return fn(q=d["q"], k=d["k"], v=d["v"], g=d["g"], beta=d["beta"], A_log=d["A"], dt_bias=d["dt"],
              initial_state=kw.pop("initial_state", d.get("s0")), output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              cu_seqlens=cus, **kw)


# ------------------------------------------------------------------------------------------------- allow_neg_eigval


@cpu_only
def test_neg_eigval_state_v_first_chunk(backend):
    """β = 2σ(logit) ∈ (0, 2) and states [N, H, V, K] in and out: output, final state and every gradient (through
    the logits, and to the V-first initial state) vs fp64; varlen with an empty sequence, K ≠ V."""
    cu = [0, 3, 3, 68]
    x = make_inputs(1, 68, 1, 16, 24, N=3)

    def run(d):
        o, ht = _call(chunk_kda, d, cu, initial_state=d["s0"].transpose(-1, -2), state_v_first=True,
                      allow_neg_eigval=True)
        assert ht.shape == (3, 1, 24, 16) and ht.is_contiguous()
        return o, ht.transpose(-1, -2)
    assert_close(errors(run, x, _dtype(backend), cu=cu, lb=None, beta_scale=2.0), _tol(backend))


@cpu_only
def test_allow_neg_eigval_recurrent(backend):
    x = make_inputs(2, 9, 1, 16, 24)
    run = lambda d: _call(fused_recurrent_kda, d, allow_neg_eigval=True)
    assert_close(errors(run, x, _dtype(backend), grad=False, lb=None, beta_scale=2.0), _tol(backend))


def test_allow_neg_eigval_needs_sigmoid():
    x = on_device(make_inputs(1, 4, 1, 8, 8), torch.float32, False)
    for fn in (chunk_kda, fused_recurrent_kda):
        with pytest.raises(ValueError, match="allow_neg_eigval"):
            fn(x["q"], x["k"], x["v"], -x["g"].abs(), x["beta"].sigmoid(), allow_neg_eigval=True)


# ------------------------------------------------------------------------------------------------- state_v_first


@cpu_only
def test_state_v_first_recurrent_and_pool(backend):
    """Dense call with V-first states, and a V-first state pool updated in place at its slots (a negative slot
    writes nothing)."""
    x = make_inputs(3, 2, 1, 16, 24)

    def run(d):
        o, ht = _call(fused_recurrent_kda, d, initial_state=d["s0"].transpose(-1, -2), state_v_first=True)
        return o, ht.transpose(-1, -2)
    assert_close(errors(run, x, _dtype(backend), grad=False, lb=None), _tol(backend))
    d = on_device(x, _dtype(backend), False)
    pool = torch.randn(5, 1, 24, 16, dtype=d["s0"].dtype, device=DEV)
    before = pool.clone()
    idx = torch.tensor([3, -1, 0], device=DEV)
    o, ret = _call(fused_recurrent_kda, d, initial_state=pool, ssm_state_indices=idx, state_v_first=True)
    assert ret.data_ptr() == pool.data_ptr()
    xr = dict(x, s0=torch.stack([before[3], torch.zeros_like(before[0]), before[0]]).transpose(-1, -2).double())
    ro, rh = reference(xr, lb=None)
    assert rel(o, ro) < _tol(backend)
    assert rel(pool[3].transpose(-1, -2), rh[0]) < _tol(backend) and rel(pool[0].transpose(-1, -2), rh[2]) < _tol(backend)
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


def test_transpose_state_layout_legacy():
    x = on_device(make_inputs(1, 3, 1, 8, 8), torch.float64, False)
    g, b = -x["g"].abs(), x["beta"].sigmoid()
    h0 = x["s0"].double()
    ref = chunk_kda(x["q"], x["k"], x["v"], g, b, initial_state=h0, output_final_state=True, state_v_first=True)
    for fn in (chunk_kda, fused_recurrent_kda):
        with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
            o, ht = fn(x["q"], x["k"], x["v"], g, b, initial_state=h0, output_final_state=True,
                       transpose_state_layout=True)
        assert rel(o, ref[0]) < 1e-12 and rel(ht, ref[1]) < 1e-12
        with pytest.raises(ValueError, match="transpose_state_layout"):
            fn(x["q"], x["k"], x["v"], g, b, state_v_first=True, transpose_state_layout=True)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, V, K\]"):
        chunk_kda(x["q"], x["k"], x["v"][..., :4], g, b, initial_state=h0[..., :4], state_v_first=True)


# ------------------------------------------------------------------------------------------- intermediate states


def _entry_states(x: dict, cu: list[int], C: int) -> torch.Tensor:
    """fp64 state entering every C-token chunk of every sequence: ``[1, Σ ⌈T_n/C⌉, H, K, V]``."""
    q, k, g, beta = activations(x, True, None)
    hs = []
    for i in range(len(cu) - 1):
        for c in range(cu[i], cu[i + 1], C):
            sl = slice(cu[i], c)
            _, s = naive_recurrent_kda(q[:, sl], k[:, sl], x["v"][:, sl], g[:, sl], beta[:, sl], None,
                                       x["s0"][i:i + 1], True)
            hs.append(s[0])
    return torch.stack(hs)[None]


@cpu_only
@pytest.mark.parametrize("chunk_size", [64, 32])
def test_return_intermediate_states(backend, chunk_size):
    """h = the state entering every chunk (varlen: sequence-major, an empty sequence has none), in q's dtype; o and
    the final states as without it; V-first h with state_v_first."""
    cu = [0, 3, 3, 70]
    x = make_inputs(1, 70, 1, 16, 24, N=3)
    d = on_device(x, _dtype(backend), False)
    with torch.inference_mode():
        o, ht, h = _call(chunk_kda, d, cu, return_intermediate_states=True, chunk_size=chunk_size)
        if backend == "torch":  # the layout is the boundary's (the same for both backends)
            _, _, hv = _call(chunk_kda, d, cu, initial_state=d["s0"].transpose(-1, -2).contiguous(),
                             return_intermediate_states=True, chunk_size=chunk_size, state_v_first=True)
            assert rel(hv.transpose(-1, -2), _entry_states(x, cu, chunk_size)) < _tol(backend)
    ref = _entry_states(x, cu, chunk_size)
    assert h.shape == ref.shape and h.dtype == d["q"].dtype
    assert rel(h, ref) < _tol(backend)
    ro, rh = reference(x, lb=None, cu=cu)
    assert rel(o, ro) < _tol(backend) and rel(ht, rh) < _tol(backend)


@cpu_only
def test_return_intermediate_states_dense(backend):
    x = make_inputs(2, 65, 1, 16, 16)
    d = on_device(x, _dtype(backend), False)
    with torch.inference_mode():
        _, _, h = _call(chunk_kda, d, return_intermediate_states=True)
    ref = torch.cat([_entry_states({n: t if n in ("A", "dt") else t[b:b + 1] for n, t in x.items()}, [0, 65], 64)
                     for b in range(2)])
    assert h.shape == (2, 2, 1, 16, 16)
    assert rel(h, ref) < _tol(backend)


def test_return_intermediate_states_errors():
    x = on_device(make_inputs(1, 3, 1, 8, 8), torch.float32, False)
    for kw, ctx in (({}, torch.no_grad()), ({"disable_recompute": True}, torch.inference_mode())):
        with ctx, pytest.raises(ValueError, match="return_intermediate_states") as e:
            _call(chunk_kda, x, return_intermediate_states=True, **kw)
        assert isinstance(e.value, AssertionError)  # fla asserts these


# ------------------------------------------------------------------ chunk_size, disable_recompute, cu_seqlens_cpu, graph


def test_accepted_arguments_same_results(monkeypatch):
    """chunk_size 32/64, disable_recompute, cu_seqlens_cpu and use_graph (cu_seqlens padded with empty tail
    sequences to max_num_seqs + 1) give the same results; bad values raise fla's exception type."""
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    cu = [0, 5, 12]
    x = on_device(make_inputs(1, 12, 1, 8, 8, N=2), torch.float64, False)
    base = _call(chunk_kda, x, cu)
    for kw in ({"chunk_size": 32}, {"disable_recompute": True},
               {"cu_seqlens_cpu": torch.tensor(cu)}, {"use_graph": True}, {"use_graph": True, "max_num_seqs": 2}):
        out = _call(chunk_kda, x, cu, **kw)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]), kw
    pad = dict(x, s0=torch.cat([x["s0"], torch.zeros_like(x["s0"])]))
    o, ht = _call(chunk_kda, pad, cu + [12, 12], use_graph=True, max_num_seqs=4)
    assert torch.equal(o, base[0]) and torch.equal(ht[:2], base[1])
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
        _call(chunk_kda, x, cu, chunk_size=16)
    with pytest.raises(AssertionError, match="max_num_seqs"):
        _call(chunk_kda, x, cu, use_graph=True, max_num_seqs=3)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        _call(chunk_kda, x, cu, cu_seqlens_cpu=torch.tensor(cu[:2]))


@cpu_only
def test_cu_seqlens_cpu_triton(monkeypatch):
    """The host copy feeds the Triton path's chunk table and the split plan: the same bits as without it, in the
    windowed forward and a forced split."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    cu = [0, 5, 140]  # 135 tokens: the forced split cuts the second sequence at 64 and 128
    x = on_device(make_inputs(1, 140, 1, 16, 16, N=2), torch.float32, False)
    kw = dict(lower_bound=-5.0, safe_gate=True)
    for splits in ("1", "2"):
        monkeypatch.setenv("K3_KDA_SPLITS", splits)
        base = _call(chunk_kda, x, cu, **kw)
        out = _call(chunk_kda, x, cu, cu_seqlens_cpu=torch.tensor(cu), **kw)
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]), splits


# ------------------------------------------------------------------------------------------------- fla's names


def test_fused_kda_gate_and_naive():
    """fused_kda_gate (fla's signature) vs the formulas, gradients included; naive_* with fla's GVA (v has twice
    q's heads) and positional chunk_size agree with each other."""
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(2, 3, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    A = torch.randn(1, 1, 2, 1, generator=gen, dtype=torch.float64, requires_grad=True)
    dt = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    x = f + dt.view(2, 8)
    for lb, ref in ((None, -A.view(2, 1).exp() * torch.nn.functional.softplus(x)),
                    (-3.0, -3.0 * torch.sigmoid(A.view(2, 1).exp() * x))):
        got = fused_kda_gate(f, A, dt, lb, torch.float64)
        assert rel(got, ref) < 1e-14
        ga = torch.autograd.grad(got.sum(), (f, A, dt))
        gr = torch.autograd.grad(ref.sum(), (f, A, dt))
        assert all(rel(a, b) < 1e-14 for a, b in zip(ga, gr))
    assert fused_kda_gate(f.float(), None, dt, -5.0).dtype == torch.float32
    q = torch.nn.functional.normalize(torch.randn(2, 40, 1, 8, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(2, 40, 1, 8, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(2, 40, 2, 4, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, 40, 2, 8, generator=gen, dtype=torch.float64)
    b = torch.rand(2, 40, 2, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 2, 8, 4, generator=gen, dtype=torch.float64)
    o1, s1 = naive_recurrent_kda(q, k, v, g, b, 0.5, h0, True)
    o2, s2 = naive_chunk_kda(q, k, v, g, b, 0.5, h0, True, 32)
    assert o1.dtype == v.dtype == o2.dtype
    assert rel(o1, o2) < 1e-12 and rel(s1, s2) < 1e-12


# ------------------------------------------------------------------------------------------------------ GPU (bf16)


@gpu
@pytest.mark.parametrize("cu", [None, [0, 100, 100, 333]])
def test_gpu_fla_arguments_bf16(monkeypatch, cu):
    """bf16 on the Triton kernels: allow_neg_eigval + state_v_first through training, intermediate states at 64 and
    32, the V-first pool in decode; against the fp64 recurrence."""
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    B, T = (2, 200) if cu is None else (1, 333)
    N = B if cu is None else len(cu) - 1
    x = make_inputs(B, T, 2, 128, 128, N=N)

    def run(d):
        o, ht = _call(chunk_kda, d, cu, initial_state=d["s0"].transpose(-1, -2), state_v_first=True,
                      allow_neg_eigval=True)
        return o, ht.transpose(-1, -2)
    assert_close(errors(run, x, torch.bfloat16, cu=cu, lb=None, beta_scale=2.0), 2e-2)
    d = on_device(x, torch.bfloat16, False)
    cuc = cu or [0, T, 2 * T]
    if cu is None:  # the dense batch packed as a varlen stream for the per-sequence reference
        x = {n: (t.reshape(1, B * T, *t.shape[2:]) if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
        d = on_device(x, torch.bfloat16, False)
    for C in (64, 32):
        with torch.inference_mode():
            _, _, h = _call(chunk_kda, d, cuc, return_intermediate_states=True, chunk_size=C)
        assert h.dtype == torch.bfloat16 and rel(h, _entry_states(x, cuc, C)) < 2e-2


@gpu
def test_gpu_state_v_first_pool_bf16():
    x = make_inputs(4, 1, 2, 128, 128)
    d = on_device(x, torch.bfloat16, False)
    pool = torch.randn(6, 2, 128, 128, device=DEV)
    before = pool.clone()
    idx = torch.tensor([5, 0, -1, 2], device=DEV, dtype=torch.int32)
    o, _ = _call(fused_recurrent_kda, d, initial_state=pool, ssm_state_indices=idx, state_v_first=True,
                 allow_neg_eigval=True)
    s0 = torch.stack([before[5], before[0], torch.zeros_like(before[0]), before[2]]).transpose(-1, -2)
    ro, rh = reference(dict(x, s0=s0.double().cpu()), lb=None, beta_scale=2.0)
    assert rel(o, ro) < 2e-2
    for n, s in ((0, 5), (1, 0), (3, 2)):
        assert rel(pool[s].transpose(-1, -2), rh[n]) < 1e-2
    assert torch.equal(pool[[1, 3, 4]], before[[1, 3, 4]])


@gpu
@pytest.mark.parametrize("K,cu", [(60, [0, 15]), (100, [0, 15, 100, 300, 1200, 2000])])
def test_gpu_fp16_hard_resets_softplus_gate(K, cu):
    """fla's fp16 varlen case: raw gates masked to −1000 (10%), the unbounded softplus gate in the kernel with
    exp(A_log) up to 16, post-sigmoid β; fla's tolerances (o 0.5%, dq/dv/dh0 0.7%, dk 0.8%, dg/dβ 1.5%,
    ddt_bias 0.5%; dA_log only warned about there: 2% here) against the fp64 recurrence."""
    gen = torch.Generator().manual_seed(0)
    T, H, N = cu[-1], 4, len(cu) - 1
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g = r(1, T, H, K)
    g = torch.where(torch.rand(g.shape, generator=gen, dtype=torch.float64) > 0.1, g, torch.full_like(g, -1000.0))
    x = dict(q=torch.nn.functional.normalize(r(1, T, H, K), dim=-1),
             k=torch.nn.functional.normalize(r(1, T, H, K), dim=-1), v=r(1, T, H, K), g=g,
             beta=torch.rand(1, T, H, generator=gen, dtype=torch.float64).sigmoid(),
             A=torch.empty(H, dtype=torch.float64).uniform_(1, 16, generator=gen).log(), dt=r(H * K), s0=r(N, H, K, K))
    kw = dict(gate=True, lb=None, l2=False, bsig=False)
    errs = errors(public_call(cu, **kw), x, torch.float16, cu=cu, **kw)
    assert_close(errs, 5e-3, dq=7e-3, dk=8e-3, dv=7e-3, dg=1.5e-2, dbeta=1.5e-2, ds0=7e-3, dA=2e-2)


@gpu
def test_gpu_varlen_capture_refused():
    """A varlen chunk_kda inside CUDA-graph capture raises instead of recording host-built chunk tables."""
    x = on_device(make_inputs(1, 64, 2, 64, 64, N=2), torch.bfloat16, False)
    cu_cpu = torch.tensor([0, 30, 64])
    cu = cu_cpu.to(DEV)  # made before the capture (a host-to-device copy cannot be captured)
    args = (x["q"], x["k"], x["v"], -x["g"].float().abs(), x["beta"].float().sigmoid())
    chunk_kda(*args, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # warm-up (compiles) outside the capture
    torch.cuda.synchronize()
    with pytest.raises(NotImplementedError, match="CUDA graph"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        chunk_kda(*args, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_graph=True)


@gpu
def test_gpu_accepted_arguments_same_results_bf16():
    """bf16 on the Triton kernels, training and inference: chunk_size 32, disable_recompute, cu_seqlens_cpu and
    use_graph (cu_seqlens padded with empty tail sequences) give the same bits as the plain call."""
    cu = [0, 100, 333]
    x = on_device(make_inputs(1, 333, 2, 128, 128, N=2), torch.bfloat16, False)
    for grad in (False, True):
        xs = {n: t.detach().clone().requires_grad_(grad) for n, t in x.items()}
        base = _call(chunk_kda, xs, cu)
        for kw in ({"chunk_size": 32}, {"disable_recompute": True}, {"cu_seqlens_cpu": torch.tensor(cu)},
                   {"use_graph": True, "max_num_seqs": 2}):
            out = _call(chunk_kda, xs, cu, **kw)
            assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1]), (grad, kw)
        pad = dict(xs, s0=torch.cat([xs["s0"], torch.zeros_like(xs["s0"])]))
        o, ht = _call(chunk_kda, pad, cu + [333, 333], use_graph=True, max_num_seqs=4)
        assert torch.equal(o, base[0]) and torch.equal(ht[:2], base[1]), grad
