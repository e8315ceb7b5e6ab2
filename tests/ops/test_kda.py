"""chunk_kda / fused_recurrent_kda (torch backend) against the fp64 token recurrence: outputs, final states and
every input gradient by relative RMS error; odd lengths, varlen, extreme gates/β, repeated keys, causality, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_pool, naive_chunk_kda, naive_recurrent_kda
from k3.ops.kda.args import get_backend, select_backend


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ‖a − b‖ / ‖b‖ in fp64."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))  # floor: an exactly-zero reference gradient


def make(B, T, H, K, V, dtype=torch.float64, seed=0, gate="log", state=False, N=None):
    """Random KDA inputs; gate='log' gives g ∈ (−5, 0), 'raw' gives pre-activations."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    g = -5 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) if gate == "log" else r(B, T, H, K)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    out = [x.to(dtype) for x in (q, k, v, g, beta)]
    S0 = r(N or B, H, K, V).to(torch.float64 if dtype == torch.float64 else torch.float32) if state else None
    return out, S0


def grads(fn, tensors, seed=1):
    """(outputs, grads of every tensor) for loss = Σ o·do + Σ S·dS with fixed random do, dS."""
    ts = [t.detach().clone().requires_grad_(True) for t in tensors]
    o, S = fn(*ts)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
    if S is not None:
        loss = loss + (S.double() * torch.randn(S.shape, generator=gen, dtype=torch.float64)).sum()
    gs = torch.autograd.grad(loss, [t for t in ts if t.is_floating_point()], allow_unused=True)
    return (o, S), gs


def assert_all_close(got, ref, tol):
    (o1, S1), g1 = got
    (o2, S_b), g_b = ref
    assert rel(o1, o2) <= tol, f"output rel err {rel(o1, o2)}"
    if S_b is not None:
        assert rel(S1, S_b) <= tol, f"final state rel err {rel(S1, S_b)}"
    for i, (a, b) in enumerate(zip(g1, g_b)):
        assert a is not None and b is not None, f"missing gradient #{i}"
        assert rel(a, b) <= tol, f"gradient #{i} rel err {rel(a, b)}"


@pytest.mark.parametrize("T,H,K,V", [(1, 2, 8, 8), (63, 2, 8, 12), (100, 3, 16, 8), (400, 1, 8, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent_fp64(T, H, K, V, with_state):
    (q, k, v, g, b), S0 = make(2 if T < 400 else 1, T, H, K, V, state=with_state)
    ins = [q, k, v, g, b] + ([S0] if with_state else [])

    def ours(q, k, v, g, b, S0=None):
        return chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)

    def ref(q, k, v, g, b, S0=None):
        return naive_recurrent_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)

    assert_all_close(grads(ours, ins), grads(ref, ins), 1e-10)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_fp32_vs_fp64_reference(chunk_size):
    (q, k, v, g, b), S0 = make(2, 100, 2, 16, 16, state=True)
    ref = grads(lambda *a: naive_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True),
                [q, k, v, g, b, S0])
    ours = grads(lambda *a: naive_chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,
                                            chunk_size=chunk_size),
                 [x.float() for x in (q, k, v, g, b, S0)])
    assert ours[0][0].dtype == torch.float32 and ours[0][1].dtype == torch.float32
    assert_all_close(ours, ref, 1e-5)


def _fused_ref(q, k, v, g, b, A_log, dt_bias, lower_bound, S0):
    """The in-kernel activations written out independently of k3's helpers, then the recurrence."""
    n = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    H, K = g.shape[-2:]
    x = g + dt_bias.view(H, K)
    if lower_bound is None:
        gg = -A_log.exp().view(H, 1) * F.softplus(x)
    else:
        gg = lower_bound * torch.sigmoid(A_log.exp().view(H, 1) * x)
    return naive_recurrent_kda(n(q), n(k), v, gg, torch.sigmoid(b), initial_state=S0, output_final_state=True)


@pytest.mark.parametrize("lower_bound", [-5.0, -1.0, None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_gate_l2norm_beta_sigmoid(lower_bound, dtype):
    (q, k, v, g, b), S0 = make(1, 70, 2, 8, 8, gate="raw", state=True, dtype=dtype)
    b = b * 8 - 4  # logits
    gen = torch.Generator().manual_seed(3)
    A_log = torch.randn(2, generator=gen, dtype=torch.float64).to(torch.float32 if dtype == torch.float32 else dtype)
    dt_bias = torch.randn(16, generator=gen, dtype=torch.float64).to(A_log.dtype)
    ins = [q * 3, k * 3, v, g, b, A_log, dt_bias, S0]

    def ours(q, k, v, g, b, A_log, dt_bias, S0):
        return chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound is not None,
                         lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)

    ref = grads(lambda *a: _fused_ref(*a[:7], lower_bound, a[7]), [x.double() for x in ins])
    assert_all_close(grads(ours, ins), ref, 1e-10 if dtype == torch.float64 else 1e-5)


def test_varlen_matches_per_sequence():
    lens = [5, 64, 1, 100, 30]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    (q, k, v, g, b), S0 = make(1, sum(lens), 2, 8, 8, state=True, N=len(lens))

    def ours(q, k, v, g, b, S0):
        return chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True, cu_seqlens=cu)

    def ref(q, k, v, g, b, S0):
        outs, fins = [], []
        for n in range(len(lens)):
            s = slice(int(cu[n]), int(cu[n + 1]))
            o, S = naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], b[:, s], initial_state=S0[n:n + 1],
                                       output_final_state=True)
            outs.append(o)
            fins.append(S)
        return torch.cat(outs, 1), torch.cat(fins, 0)

    ins = [q, k, v, g, b, S0]
    assert_all_close(grads(ours, ins), grads(ref, ins), 1e-10)


@pytest.mark.parametrize("case", ["gate_at_bound", "beta_near_0", "beta_near_1", "repeated_keys", "gate_zero"])
def test_extremes_fp32(case):
    (q, k, v, g, b), S0 = make(1, 100, 2, 16, 8, state=True)
    if case == "gate_at_bound":
        g = torch.full_like(g, -5.0)
    elif case == "gate_zero":
        g = torch.zeros_like(g)
    elif case == "beta_near_0":
        b = torch.full_like(b, 1e-6)
    elif case == "beta_near_1":
        b = torch.full_like(b, 1 - 1e-6)
    else:  # every token has the same key (and β≈1): T=(I+A)^-1 is as ill-conditioned as KDA gets
        k = k[:, :1].expand_as(k).contiguous()
        b = torch.full_like(b, 1 - 1e-6)
    ins = [q, k, v, g, b, S0]
    ref = grads(lambda *a: naive_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True), ins)
    ours = grads(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True),
                 [x.float() for x in ins])
    assert_all_close(ours, ref, 1e-5)


@pytest.mark.parametrize("t", [1, 40, 64, 65, 99])
def test_causality_bitwise(t):
    (q, k, v, g, b), _ = make(1, 100, 2, 8, 8, dtype=torch.float32)
    o1, _ = chunk_kda(q, k, v, g, b)
    gen = torch.Generator().manual_seed(7)
    q_b, k_b, v_b, b_b = (x.clone() for x in (q, k, v, b))
    g_b = g.clone()
    for x in (q_b, k_b, v_b, g_b):
        x[:, t:] = torch.randn(x[:, t:].shape, generator=gen)
    g_b[:, t:] = -g_b[:, t:].abs()
    b_b[:, t:] = torch.rand(b_b[:, t:].shape, generator=gen)
    o2, _ = chunk_kda(q_b, k_b, v_b, g_b, b_b)
    assert torch.equal(o1[:, :t], o2[:, :t])
    assert not torch.equal(o1[:, t:], o2[:, t:])


def test_output_dtype_and_state_dtype():
    (q, k, v, g, b), _ = make(1, 20, 2, 8, 8, dtype=torch.bfloat16)
    o, S = chunk_kda(q, k, v, g, b, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32 and o.shape == (1, 20, 2, 8)
    o2, S_b = fused_recurrent_kda(q, k, v, g, b, output_final_state=True)
    assert rel(o2, o) < 2e-2 and rel(S_b, S) < 1e-4 and o2.dtype == torch.bfloat16
    # mixed dtypes: the output takes v's dtype, as fla allocates it (zeros_like(v))
    o3, _ = chunk_kda(q, k, v.float(), g, b)
    o4, _ = fused_recurrent_kda(q, k, v.float(), g, b)
    assert o3.dtype == o4.dtype == torch.float32 and rel(o3, o) < 2e-2 and rel(o4, o) < 2e-2


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fused_recurrent_matches_chunk(lower_bound):
    lens = [3, 1, 17]
    cu = torch.tensor([0, 3, 4, 21])
    (q, k, v, g, b), S0 = make(1, 21, 2, 8, 8, gate="raw", state=True, N=3, dtype=torch.float32)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=lower_bound, A_log=torch.zeros(2), dt_bias=torch.zeros(16), cu_seqlens=cu,
              initial_state=S0, output_final_state=True)
    o1, S1 = chunk_kda(q, k, v, g, b, **kw)
    o2, S_b = fused_recurrent_kda(q, k, v, g, b, **kw)
    assert not o2.requires_grad
    assert rel(o2, o1) < 1e-5 and rel(S_b, S1) < 1e-5 and len(lens) == S_b.shape[0]


def test_fused_recurrent_takes_fla_positional_order():
    """fla's ``fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, ...)``: a positional fla call gives
    the keyword call's result."""
    (q, k, v, g, b), S0 = make(2, 5, 2, 8, 8, gate="raw", state=True, dtype=torch.float32)
    A_log, dt_bias = torch.randn(2) * 0.3, torch.randn(16) * 0.3
    o1, S1 = fused_recurrent_kda(q, k, v, g, b, A_log, dt_bias, 0.3, S0, True, True, True, True)
    o2, S_b = fused_recurrent_kda(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, scale=0.3, initial_state=S0,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True)
    o3, _ = fused_recurrent_kda(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, scale=0.5, initial_state=S0,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert torch.equal(o1, o2) and torch.equal(S1, S_b) and not torch.equal(o1, o3)


def test_state_pool_in_place():
    (q, k, v, g, b), _ = make(3, 1, 2, 8, 8, dtype=torch.float32)
    pool = torch.randn(6, 2, 8, 8)
    before = pool.clone()
    idx = torch.tensor([4, 0, 2])
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, b, initial_state=pool[idx], output_final_state=True)
    o, ret = fused_recurrent_kda(q, k, v, g, b, initial_state=pool, ssm_state_indices=idx)
    assert ret is pool and rel(o, o_ref) < 1e-6 and rel(pool[idx], S_ref) < 1e-6
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])
    o3 = fused_recurrent_kda_pool(q, k, v, g, b, pool, idx)  # a second step continues from the updated slots
    o3_ref, _ = naive_recurrent_kda(q, k, v, g, b, initial_state=S_ref, output_final_state=True)
    assert rel(o3, o3_ref) < 1e-6
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda_pool(q, k, v, g, b, pool, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda_pool(q, k, v, g, b, pool, torch.tensor([0, 6, 1]))
    with pytest.raises(ValueError, match="state_pool"):
        fused_recurrent_kda_pool(q, k, v, g, b, pool.double(), idx)
    # negative slots (padding rows, as on the GPU kernels): start from zero, write nothing; several may repeat
    pad = torch.tensor([-1, 3, -1])
    before = pool.clone()
    o_pad = fused_recurrent_kda_pool(q, k, v, g, b, pool, pad)
    o0_ref, S0_ref = naive_recurrent_kda(q, k, v, g, b, initial_state=torch.zeros_like(pool[:3]),
                                         output_final_state=True)
    o1_ref, S1_ref = naive_recurrent_kda(q, k, v, g, b, initial_state=before[[0, 3, 0]], output_final_state=True)
    assert rel(o_pad[[0, 2]], o0_ref[[0, 2]]) < 1e-6 and rel(o_pad[1], o1_ref[1]) < 1e-6
    assert rel(pool[3], S1_ref[1]) < 1e-6 and torch.equal(pool[[0, 1, 2, 4, 5]], before[[0, 1, 2, 4, 5]])
    with pytest.raises(ValueError, match="initial_state"):  # slots without a pool
        fused_recurrent_kda(q, k, v, g, b, initial_state=None, ssm_state_indices=idx)


@pytest.mark.parametrize("fused", [False, True])
def test_grouped_value_attention(fused):
    """fla's GVA: v, g, β, A_log, dt_bias and states have HV = G·H heads; value head j reads q/k head j // G. The
    reference gathers each value head's query/key by that index (not by the entry point's repeat_interleave)."""
    B, T, H, G, K, V = 2, 37, 2, 3, 8, 8
    HV = G * H
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, graw, braw, S0 = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV, K), r(B, T, HV), r(B, HV, K, V)
    A_log, dt_bias = r(HV) * 0.5, r(HV * K) * 0.5
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=fused, lower_bound=-5.0 if fused else None)
    head = torch.arange(HV) // G

    def ours(q, k, v, graw, braw, S0, A_log, dt_bias):
        return chunk_kda(q, k, v, graw, braw, initial_state=S0, output_final_state=True, A_log=A_log,
                         dt_bias=dt_bias, **kw)

    def ref(q, k, v, graw, braw, S0, A_log, dt_bias):
        qn, kn = F.normalize(q[:, :, head], dim=-1, eps=0), F.normalize(k[:, :, head], dim=-1, eps=0)
        x = graw + dt_bias.view(HV, K)
        if fused:
            g = -5.0 * torch.sigmoid(A_log.exp()[:, None] * x)
        else:
            g = -A_log.exp()[:, None] * F.softplus(x)
        return naive_recurrent_kda(qn, kn, v, g, braw.sigmoid(), initial_state=S0, output_final_state=True)

    ins = [q, k, v, graw, braw, S0, A_log, dt_bias]
    got, want = grads(ours, ins), grads(ref, ins)
    assert got[0][0].shape == (B, T, HV, V) and got[0][1].shape == (B, HV, K, V)
    assert got[1][0].shape == q.shape and got[1][1].shape == k.shape
    assert_all_close(got, want, 1e-6)  # the in-kernel L2 norm's 1e-6 under the root differs from the exact norm
    o, S = fused_recurrent_kda(q, k, v, graw, braw, A_log, dt_bias, initial_state=S0, output_final_state=True, **kw)
    assert rel(o, want[0][0]) < 1e-6 and rel(S, want[0][1]) < 1e-6
    with pytest.raises(ValueError, match="v has 5 heads"):
        chunk_kda(q, k, v[:, :, :5], graw[:, :, :5], braw[:, :, :5])
    with pytest.raises(ValueError, match="g must"):  # g keeps q's head count: named, not broadcast
        chunk_kda(q, k, v, graw[:, :, :H], braw)


@pytest.mark.parametrize("B,T", [(1, 0), (0, 5), (2, 0)])
def test_empty_batch_or_sequence(B, T):
    """No tokens (T = 0) or no sequences (B = 0): empty outputs, the initial state (or zeros) as the final state,
    and a backward that runs."""
    (q, k, v, g, b), S0 = make(B, T, 2, 8, 8, state=True, dtype=torch.float32)
    S0.requires_grad_()
    o, S = chunk_kda(q.requires_grad_(), k, v, g, b, initial_state=S0, output_final_state=True)
    assert o.shape == (B, T, 2, 8) and S.shape == (B, 2, 8, 8) and torch.equal(S, S0)
    (o.sum() + S.sum()).backward()
    assert q.grad.shape == q.shape and torch.equal(S0.grad, torch.ones_like(S0))
    o2, S_b = fused_recurrent_kda(q.detach(), k, v, g, b, initial_state=S0.detach(), output_final_state=True)
    assert o2.shape == o.shape and torch.equal(S_b, S0.detach())


def _bad_calls():
    (q, k, v, g, b), _ = make(2, 10, 2, 8, 8, dtype=torch.float32)
    S = torch.zeros(2, 2, 8, 8)
    cu = torch.tensor([0, 4, 10])
    return [
        ("q", dict(q=q[0])),
        ("k", dict(k=k[..., :4])),
        ("v", dict(v=v[:, :, :1])),  # mismatched heads
        ("g", dict(g=g[:, :5])),
        ("beta", dict(beta=b[..., None])),
        ("q", dict(q=q.to(torch.int32))),
        ("k", dict(k=k.half())),  # q and k must share a dtype
        ("beta", dict(beta=b.to(torch.float64).to("meta"))),  # wrong device
        ("initial_state", dict(initial_state=S.double())),
        ("initial_state", dict(initial_state=S[:1])),
        ("initial_state", dict(initial_state=S[..., :4])),
        ("lower_bound", dict(lower_bound=-6.0)),
        ("lower_bound", dict(lower_bound=0.0)),
        ("lower_bound", dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(2))),
        ("cu_seqlens", dict(cu_seqlens=cu)),  # B = 2
        ("cu_seqlens", dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=b[:1], cu_seqlens=torch.tensor([0, 4, 9]))),
        ("cu_seqlens", dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=b[:1], cu_seqlens=cu.float())),
        ("A_log", dict(use_gate_in_kernel=True)),
        ("A_log", dict(use_gate_in_kernel=True, A_log=torch.zeros(3))),
        ("dt_bias", dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(15))),
        ("scale", dict(scale=-1.0)),
    ], dict(q=q, k=k, v=v, g=g, beta=b)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_value_errors(fn):
    cases, base = _bad_calls()
    for name, over in cases:
        kw = {**base, **over}
        with pytest.raises(ValueError, match=name):
            fn(**kw)


def test_lower_bound_reaches_the_kernels_only_as_a_promise():
    """What the kernels read as ``lower_bound`` (``KDAArgs.lower_bound``): the bounded form's bound with the gate in
    the kernel; with a precomputed g, a bound only under safe_gate (−5 if not given: the caller's promise that every
    log-decay is ≥ it), else None — a lower_bound alone bounds nothing (as in fla), the exact path runs."""
    from k3.ops.kda.args import kda_args

    (q, k, v, g, b), _ = make(1, 4, 1, 8, 8, dtype=torch.float32)
    base = dict(scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, cu_seqlens=None, A_log=torch.zeros(1), dt_bias=None)
    lb = lambda **kw: kda_args(q, k, v, g, b, **{**base, **kw}).lower_bound  # noqa: E731
    assert lb(use_gate_in_kernel=True, safe_gate=True, lower_bound=-3.0) == -3.0
    assert lb(use_gate_in_kernel=True, safe_gate=False, lower_bound=None) is None  # the softplus gate
    assert lb(use_gate_in_kernel=False, safe_gate=False, lower_bound=-3.0) is None
    assert lb(use_gate_in_kernel=False, safe_gate=True, lower_bound=-3.0) == -3.0
    assert lb(use_gate_in_kernel=False, safe_gate=True, lower_bound=None) == -5.0


def test_backend_selection(monkeypatch):
    assert select_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("K3_KDA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="K3_KDA_BACKEND"):
        select_backend(torch.device("cpu"))
    monkeypatch.delenv("K3_KDA_BACKEND")
    assert select_backend(torch.device("cpu")) == "torch"
    try:
        get_backend("triton")
    except RuntimeError:
        monkeypatch.setenv("K3_KDA_BACKEND", "triton")
        with pytest.raises(RuntimeError, match="triton"):
            select_backend(torch.device("cpu"))
