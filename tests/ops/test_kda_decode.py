"""KDA decode (``fused_recurrent_kda``) on the Triton backend against the fp64 token recurrence: the Triton kernel of
``decode.py`` (CPU interpreter; several tokens, varlen, the pool, and the fallback of the dense step) and the Gluon
step (GPU); the host side of one call (what it validates, how many torch ops it runs, the launch cache).
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import k3.ops.kda.triton.decode as dec  # noqa: E402
import k3.ops.kda.triton.decode_gluon as dg  # noqa: E402
from k3.ops.kda import fused_recurrent_kda, naive_recurrent_kda  # noqa: E402
from k3.ops.kda.args import _checked_dims, _common_call_dims, kda_args  # noqa: E402
from k3.ops.kda.gate import kda_gate_fused  # noqa: E402
from k3.ops.kda.triton import _common as common  # noqa: E402
from tests.ops.kda_ref import CUDA, cpu_only, gpu  # noqa: E402
from tests.ops.kernel_spy import KernelSpy  # noqa: E402

gluon_gpu = pytest.mark.skipif(not (CUDA and common.HAVE_GLUON), reason="needs CUDA and Gluon")
needs_gluon = pytest.mark.skipif(not common.HAVE_GLUON, reason="this Triton has no Gluon")

H, K, V = 2, 16, 32
LB = -5.0


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make(B: int, T: int, N: int | None = None, seed: int = 0, g_raw: float | None = None,
         beta_logit: float | None = None, repeat_keys: bool = False, K: int = K, V: int = V) -> dict:
    """fp64 inputs in the K3 setting: raw gate pre-activations, β logits, A_log [H], dt_bias [H·K], state s0."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K), beta=r(B, T, H),
             A=0.5 * r(H), dt=0.5 * r(H * K), s0=r(N or B, H, K, V))
    if repeat_keys:
        x["k"] = x["k"][:, :1].expand_as(x["k"]).clone()
    if g_raw is not None:  # λ·σ(e^A (60 + dt)) rounds to λ: every log-decay at the bound
        x["g"] = torch.full_like(x["g"], g_raw)
    if beta_logit is not None:
        x["beta"] = torch.full_like(x["beta"], beta_logit)
    return x


def cast(x: dict, dtype: torch.dtype) -> dict:
    """Inputs in ``dtype`` (states and gate parameters fp32), and the same values back in fp64 for the reference."""
    lo = {n: t.to(torch.float32 if n in ("A", "dt", "s0") else dtype) for n, t in x.items()}
    return lo, {n: t.double() for n, t in lo.items()}


def reference(x: dict, cu: list[int] | None = None, h0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64: L2 norm of q/k, bounded gate, β sigmoid, then the token recurrence per sequence."""
    nrm = lambda t: t / (t.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    q, k, v = nrm(x["q"]), nrm(x["k"]), x["v"]
    g, b = kda_gate_fused(x["g"], x["A"], x["dt"], LB), x["beta"].sigmoid()
    s0 = x["s0"] if h0 else torch.zeros_like(x["s0"])
    scale = q.shape[-1] ** -0.5
    if cu is None:
        return naive_recurrent_kda(q, k, v, g, b, scale, s0, True)
    outs, states = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        o, s = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], b[:, sl], scale, s0[i:i + 1], True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def ours(x: dict, h0: bool = True, cu: list[int] | None = None, **kw) -> tuple:
    """The public API with the K3 flags (gate, L2 norm and β sigmoid in the kernel)."""
    return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"] if h0 else None,
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=x["A"],
                               dt_bias=x["dt"], cu_seqlens=torch.tensor(cu) if cu is not None else None, **kw)


def assert_close(o, s, ro, rs, tol_o: float, tol_s: float = 1e-5) -> None:
    eo, es = rel(o, ro), rel(s, rs)
    assert eo <= tol_o and es <= tol_s, f"o {eo:.2e} (tol {tol_o}), state {es:.2e} (tol {tol_s})"  # NaN fails


# ------------------------------------------------------------------------------------------------ Triton kernel


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_step(nan_empty, dtype):
    """One token (B = 3), with and without an initial state; K = 12, V = 20 (padded tiles)."""
    lo, hi = cast(make(3, 1, seed=1), dtype)
    o, s = ours(lo)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close(o, s, *reference(hi), 1e-5 if dtype == torch.float32 else 2e-3)
    o, s = ours(lo, h0=False)
    assert_close(o, s, *reference(hi, h0=False), 1e-5 if dtype == torch.float32 else 2e-3)
    lo, hi = cast(make(2, 1, seed=6, K=12, V=20), torch.float32)
    assert_close(*ours(lo), *reference(hi), 1e-5)


@cpu_only
def test_decode_few_tokens_dense_and_varlen(nan_empty):
    """T = 5 dense, and a varlen batch with an empty sequence."""
    lo, hi = cast(make(2, 5, seed=2), torch.float32)
    assert_close(*ours(lo), *reference(hi), 1e-5)
    cu = [0, 2, 2, 7]
    lo, hi = cast(make(1, 7, N=3, seed=3), torch.float32)
    assert_close(*ours(lo, cu=cu), *reference(hi, cu=cu), 1e-5)


@cpu_only
def test_decode_extremes(nan_empty):
    """Every log-decay at the bound with β ≈ 1 and identical keys; β ≈ 0 (3 tokens, so the state feeds back)."""
    for beta_logit, rep in ((12.0, True), (-12.0, False)):
        lo, hi = cast(make(3, 3, seed=4, g_raw=60.0, beta_logit=beta_logit, repeat_keys=rep), torch.float32)
        assert bool((kda_gate_fused(hi["g"], hi["A"], hi["dt"], LB) == LB).all())
        assert_close(*ours(lo), *reference(hi), 1e-5)


@cpu_only
def test_decode_pool_in_place(nan_empty):
    """State pool: slots read and written in place (int64 and int32 indices), a negative slot starts from zero
    and writes nothing, every other slot stays bitwise unchanged."""
    lo, hi = cast(make(3, 1, seed=5), torch.float32)
    ro, rs = reference(hi)
    ro0, _ = reference(hi, h0=False)
    for idx_dtype in (torch.int64, torch.int32):
        pool = torch.randn(6, H, K, V)
        pool[4], pool[1] = lo["s0"][0], lo["s0"][2]
        before = pool.clone()
        o, p = ours(dict(lo, s0=pool), ssm_state_indices=torch.tensor([4, -1, 1], dtype=idx_dtype))
        assert p is pool
        assert rel(pool[4], rs[0]) <= 1e-5 and rel(pool[1], rs[2]) <= 1e-5
        assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
        assert rel(o[[0, 2]], ro[[0, 2]]) <= 1e-5 and rel(o[1], ro0[1]) <= 1e-5
    # the public spelling (fla/vLLM style) returns the pool itself as the final state
    pool = torch.zeros(5, H, K, V)
    idx = torch.tensor([3, 0, 2])
    pool[idx] = lo["s0"]
    o, p = ours(dict(lo, s0=pool), ssm_state_indices=idx)
    assert p is pool
    assert_close(o, pool[idx], ro, rs, 1e-5)
    assert torch.count_nonzero(pool[[1, 4]]) == 0
    # a strided pool (every other slot of a larger buffer) is updated in place through a dense copy
    big = torch.randn(10, H, K, V)
    pool = big[::2]
    pool[idx] = lo["s0"]
    before = big.clone()
    o, p = ours(dict(lo, s0=pool), ssm_state_indices=idx)
    assert p is pool and not pool.is_contiguous()
    assert_close(o, pool[idx], ro, rs, 1e-5)
    assert torch.equal(big[1::2], before[1::2]) and torch.equal(pool[[1, 4]], before[::2][[1, 4]])


# ------------------------------------------------------------------------------------------------ host side


def _args(**over) -> dict:
    """A valid K3 decode call (B = 3, T = 1) as kda_args' arguments, with overrides."""
    x = make(3, 1)
    a = dict(q=x["q"].float(), k=x["k"].float(), v=x["v"].float(), g=x["g"].float(), beta=x["beta"].float(),
             scale=None, initial_state=x["s0"].float(), use_gate_in_kernel=True, safe_gate=True, lower_bound=LB,
             A_log=x["A"].float(), dt_bias=x["dt"].float())
    a.update(over)
    return a


def test_checks_accept_or_raise_value_error():
    """Every mutation of a valid decode call is either accepted with the right (scale, lower_bound) or rejected
    with ValueError — never another exception (the messages are built lazily, only when a check fails)."""
    a = _args()

    def check(**b):
        args = kda_args(b.pop("q"), b.pop("k"), b.pop("v"), b.pop("g"), b.pop("beta"), output_final_state=True,
                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=None, **b)
        return args.scale, args.lower_bound

    assert check(**a) == (K ** -0.5, LB)
    meta = {n: t.to("meta") for n, t in a.items() if isinstance(t, torch.Tensor)}
    mutations = [
        dict(q=a["q"].double()), dict(k=a["k"][..., :-1]), dict(v=a["v"][:, :, :1]), dict(g=a["g"][:1]),
        dict(beta=a["beta"][..., None]), dict(q=a["q"][0]), dict(v=a["v"].half()), dict(k=a["k"].bfloat16()),
        dict(beta=a["beta"].to(torch.int32)), dict(initial_state=a["initial_state"].double()),
        dict(initial_state=a["initial_state"][:2]), dict(initial_state=None), dict(initial_state=meta["initial_state"]),
        dict(k=meta["k"]), dict(A_log=meta["A_log"]), dict(scale=0.0), dict(scale=-1.0), dict(scale=float("inf")),
        dict(scale=float("nan")), dict(scale=2), dict(scale=0.5), dict(scale="x"), dict(lower_bound=-6.0),
        dict(lower_bound=0.0), dict(lower_bound=-5), dict(lower_bound=-0.5), dict(lower_bound=True),
        dict(lower_bound=None), dict(lower_bound=None, safe_gate=False), dict(lower_bound=None, A_log=None),
        dict(A_log=a["A_log"][:1]), dict(dt_bias=a["dt_bias"][:-1]), dict(A_log=a["A_log"].to(torch.int64)),
        dict(A_log=None), dict(dt_bias=None), dict(use_gate_in_kernel=False, A_log=a["A_log"][:1]),
        dict(dt_bias=a["dt_bias"].view(H, K)), dict(q=torch.nn.Parameter(a["q"])), dict(A_log=[0.0, 0.0]),
    ]
    accepted = 0
    for m in mutations:
        b = dict(a, **m)
        # the one-expression check of plainly valid calls never accepts what the detailed checks reject
        fast = _common_call_dims(b["q"], b["k"], b["v"], b["g"], b["beta"], b["initial_state"])
        if fast is not None:
            assert fast == _checked_dims(b["q"], b["k"], b["v"], b["g"], b["beta"], b["initial_state"], None), m
        try:
            scale, lb = check(**b)
        except ValueError as e:
            assert str(e), f"{list(m)}: empty message"
            continue
        accepted += 1
        want_scale = K ** -0.5 if b["scale"] is None else float(b["scale"])
        want_lb = None if b["lower_bound"] is None else float(b["lower_bound"])
        if not b["use_gate_in_kernel"]:  # a precomputed g: the bound only under safe_gate (−5 if not given)
            want_lb = (want_lb if want_lb is not None else -5.0) if b["safe_gate"] else None
        assert (scale, lb) == (want_scale, want_lb), f"{list(m)}: {(scale, lb)}"
    assert 8 <= accepted < len(mutations)  # both outcomes occur


def test_public_errors_name_the_argument():
    """Bad decode calls still raise ValueError naming the argument (through the fast path's fallback)."""
    a = _args()
    x = dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], s0=a["initial_state"], A=a["A_log"],
             dt=a["dt_bias"])
    for over, name in ((dict(k=a["k"][..., :-1]), "k"), (dict(beta=a["beta"][0]), "beta"),
                       (dict(s0=a["initial_state"].double()), "initial_state"), (dict(dt=a["dt_bias"][:3]), "dt_bias"),
                       (dict(v=a["v"].to("meta")), "v")):
        with pytest.raises(ValueError, match=name):
            ours(dict(x, **over))
    with pytest.raises(ValueError, match="lower_bound"):
        fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], lower_bound=-7.0)
    with pytest.raises(ValueError, match="scale"):
        fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=-1.0)


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_host_ops_per_decode_call(monkeypatch):
    """One decode call (kernel launch stubbed) runs no torch op beside allocating its outputs: no casts, copies,
    zero-fills or host syncs (each would be a launch or a sync per step)."""
    launches = []
    monkeypatch.setattr(dec, "_kda_recurrent", KernelSpy(launches=launches))
    a = _args(q=make(3, 1)["q"].half(), k=make(3, 1)["k"].half())
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=LB, A_log=a["A_log"], dt_bias=a["dt_bias"])
    with _Count() as c:
        fused_recurrent_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                            output_final_state=True, **kw)
    assert dict(c.ops) == {"aten.empty.memory_format": 2}  # o and the final state
    pool, idx = torch.zeros(5, H, K, V), torch.tensor([3, 0, 2])
    args = kda_args(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=None, initial_state=None,
                    output_final_state=False, cu_seqlens=None, **kw)
    with _Count() as c:  # the Triton function itself (CPU indices get value checks in the public wrapper)
        dec.fused_recurrent_kda_triton(a["q"], a["k"], a["v"], a["g"], a["beta"], pool, a["A_log"], a["dt_bias"],
                                       args, ssm_state_indices=idx)
    assert dict(c.ops) == {"aten.empty.memory_format": 1}  # o only: the pool is updated in place
    assert len(launches) == 2 and all(len(g) == 2 for g, _, _ in launches)



# (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, lower_bound, A_log, dt_bias)
FLAGS = {
    "k3": (True, True, True, LB, True, True),
    "bounded, no A_log / dt_bias": (True, True, True, LB, False, False),
    "unbounded gate": (True, True, False, None, True, True),
    "unbounded, A_log only": (False, True, True, None, True, False),
    "gate given (log-decay in g)": (False, False, False, None, False, False),
}


@pytest.fixture
def gluon(monkeypatch):
    """The Gluon kernel on; its launches counted, so a test knows the Gluon path really ran."""
    monkeypatch.setenv("K3_KDA_GLUON", "1")
    calls = []
    real = dg.decode_step
    monkeypatch.setattr(dg, "decode_step", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def make1(B: int, H: int, K: int, V: int, seed: int, flags: tuple, g_raw: float | None = None,
         beta_logit: float | None = None, repeat_keys: bool = False, P: int | None = None) -> dict:
    """fp64 CPU inputs of one token per sequence; the log-decay ≤ 0 when the gate is given, not computed."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, 1, H, K), k=r(B, 1, H, K), v=r(B, 1, H, V), g=r(B, 1, H, K), beta=r(B, 1, H),
             A_log=0.5 * r(H), dt_bias=0.5 * r(H * K), s0=r(P or B, H, K, V))
    if not flags[1]:
        x["g"] = -torch.nn.functional.softplus(x["g"])
    if not flags[2]:
        x["beta"] = x["beta"].sigmoid()
    if repeat_keys:
        x["k"] = x["k"][:1].expand_as(x["k"]).clone()
    if g_raw is not None:
        x["g"] = torch.full_like(x["g"], g_raw)
    if beta_logit is not None:
        x["beta"] = torch.full_like(x["beta"], beta_logit)
    return x


def call(x: dict, flags: tuple, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    l2, gate, bsig, lb, use_a, use_dt = flags
    return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"] if use_a else None,
                               dt_bias=x["dt_bias"] if use_dt else None, use_qk_l2norm_in_kernel=l2,
                               use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=bsig, safe_gate=lb is not None,
                               lower_bound=lb, **kw)


def reference1(x: dict, flags: tuple, h0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend on fp64 CPU copies of the (already rounded) inputs: the same flags, step by step."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_KDA_BACKEND", "torch")
        xs = {n: t.detach().double().cpu() for n, t in x.items()}
        return call(xs, flags, initial_state=xs["s0"] if h0 else None, output_final_state=True)


def on_gpu(x: dict, dtype: torch.dtype) -> dict:
    return {n: t.to("cuda", torch.float32 if n in ("A_log", "dt_bias", "s0") else dtype) for n, t in x.items()}


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
QUICK = pytest.mark.gpu_quick


# ------------------------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("Kd,Vd", [(16, 128), (128, 16), pytest.param(100, 72, marks=QUICK), (64, 64),
                                   pytest.param(128, 128, marks=QUICK)])
def test_gpu_decode_head_dims_bf16(monkeypatch, Kd, Vd):
    """The default dispatch (the Gluon kernel at K = V = 128, the Triton kernels otherwise) at other head dims, bf16:
    one step (B = 5) and a varlen prefix of 7 tokens, outputs and states against the fp64 recurrence."""
    for B, T, cu in ((5, 1, None), (1, 7, [0, 3, 3, 7])):
        x = make(B, T, N=None if cu is None else len(cu) - 1, seed=11, K=Kd, V=Vd)
        lo = {n: t.to("cuda", torch.float32 if n in ("A", "dt", "s0") else torch.bfloat16) for n, t in x.items()}
        hi = {n: t.double().cpu() for n, t in lo.items()}
        ro, rs = reference(hi, cu=cu)
        o, s = ours(lo, cu=cu)
        assert rel(o.cpu(), ro) <= 2e-2 and rel(s.cpu(), rs) <= 2e-2, (B, T)


@gluon_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,V", [pytest.param(128, 128, marks=QUICK), (12, 20), pytest.param(100, 72, marks=QUICK)])
@pytest.mark.parametrize("h0", [True, False])
def test_gpu_gluon_step(gluon, nan_empty, dtype, K, V, h0):
    """One token, K3 flags, fp64 reference: output and final state (fp32 state: 1e-5 whatever the inputs)."""
    x = on_gpu(make1(5, 3, K, V, seed=K + V, flags=FLAGS["k3"]), dtype)
    o, s = call(x, FLAGS["k3"], initial_state=x["s0"] if h0 else None, output_final_state=True)
    ro, rs = reference1(x, FLAGS["k3"], h0)
    assert gluon, "the Gluon kernel did not run"
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel(o.cpu(), ro) <= TOL[dtype] and rel(s.cpu(), rs) <= 1e-5, (rel(o.cpu(), ro), rel(s.cpu(), rs))


@gluon_gpu
@pytest.mark.parametrize("flags", list(FLAGS))
def test_gpu_gluon_flags(gluon, nan_empty, flags):
    """Every gate / norm / β option (fp32 inputs), and a call without output_final_state (o only)."""
    f = FLAGS[flags]
    x = on_gpu(make1(4, 2, 128, 128, seed=11, flags=f), torch.float32)
    o, s = call(x, f, initial_state=x["s0"], output_final_state=True)
    ro, rs = reference1(x, f)
    assert rel(o.cpu(), ro) <= 1e-5 and rel(s.cpu(), rs) <= 1e-5
    o2, s2 = call(x, f, initial_state=x["s0"], output_final_state=False)
    assert s2 is None and rel(o2, o) <= 1e-6  # not bitwise: without the state store the compiler fuses differently
    assert len(gluon) == 2


@gluon_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gluon_extremes(gluon, nan_empty, dtype):
    """Every log-decay at the bound with β ≈ 1 and identical keys, and β ≈ 0; every gate at σ → 0 (no decay): three
    steps, each feeding the next its state, against the fp64 recurrence over the same three tokens."""
    for g_raw, beta_logit, rep in ((60.0, 12.0, True), (60.0, -12.0, False), (-200.0, 0.0, False)):
        xs = [on_gpu(make1(3, 2, 128, 128, seed=20 + t, flags=FLAGS["k3"], g_raw=g_raw, beta_logit=beta_logit,
                          repeat_keys=rep), dtype) for t in range(3)]
        s, s_ref = xs[0]["s0"], xs[0]["s0"].double().cpu()
        for x in xs:
            o, s = call(x, FLAGS["k3"], initial_state=s, output_final_state=True)
            ro, s_ref = reference1(dict(x, s0=s_ref), FLAGS["k3"])
            assert rel(o.cpu(), ro) <= TOL[dtype] and rel(s.cpu(), s_ref) <= 1e-5
    assert len(gluon) == 9


@pytest.mark.gpu_quick
@gluon_gpu
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_gpu_gluon_pool(gluon, nan_empty, idx_dtype):
    """State pool in place: the given slots updated, a negative slot (first, middle, last sequence) starts from zero
    and writes nothing, every other slot bitwise unchanged; a strided pool through its dense copy."""
    B, Hh, D = 7, 2, 128
    x = on_gpu(make1(B, Hh, D, D, seed=30, flags=FLAGS["k3"], P=2 * B + 1), torch.bfloat16)
    idx = torch.tensor([-1, 5, 0, -1, 9, 13, -1], dtype=idx_dtype, device="cuda")
    pool = x["s0"].clone()
    before = pool.clone()
    o, p = call(x, FLAGS["k3"], initial_state=pool, ssm_state_indices=idx)
    assert p is pool
    s0 = torch.zeros(B, Hh, D, D, dtype=torch.float64)
    live = idx >= 0
    s0[live.cpu()] = before[idx[live].long()].double().cpu()
    ro, rs = reference1(dict(x, s0=s0), FLAGS["k3"])
    assert rel(o.cpu(), ro) <= 2e-2
    assert rel(pool[idx[live].long()].cpu(), rs[live.cpu()]) <= 1e-5
    untouched = torch.ones(2 * B + 1, dtype=torch.bool)
    untouched[idx[live].long().cpu()] = False
    assert torch.equal(pool[untouched.cuda()], before[untouched.cuda()])
    big = torch.zeros(2 * (2 * B + 1), Hh, D, D, device="cuda")
    strided = big[::2]
    strided.copy_(before)
    o2, p2 = call(x, FLAGS["k3"], initial_state=strided, ssm_state_indices=idx)
    assert p2 is strided and torch.equal(o2, o) and torch.equal(strided, pool)
    assert torch.count_nonzero(big[1::2]) == 0


@gluon_gpu
def test_gpu_gluon_not_used_off_its_path(monkeypatch):
    """Several tokens, varlen, or K3_KDA_GLUON=0: the Triton kernel serves (the Gluon launcher is not called)."""
    called = []
    monkeypatch.setattr(dg, "decode_step", lambda *a, **kw: called.append(1))
    x = on_gpu(make1(2, 2, 32, 32, seed=40, flags=FLAGS["k3"]), torch.float32)
    multi = {n: (t.reshape(1, 2, *t.shape[2:]) if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
    call(multi, FLAGS["k3"], initial_state=x["s0"][:1], output_final_state=True)  # B = 1, T = 2
    call(multi, FLAGS["k3"], initial_state=x["s0"], output_final_state=True,
         cu_seqlens=torch.tensor([0, 1, 2], device="cuda"))
    monkeypatch.setenv("K3_KDA_GLUON", "0")
    call(x, FLAGS["k3"], initial_state=x["s0"], output_final_state=True)
    assert not called


@gluon_gpu
def test_gpu_gluon_launch_cache(monkeypatch, nan_empty):
    """Repeated steps skip Triton's binding (``LaunchCache`` calls the compiled launcher) and stay exact on new
    tensors each step; a new specialisation (a state not 16-byte aligned, another dtype, other flags) goes
    through Triton once more, then it too is launched directly."""
    runs = []
    real = dg._kda_decode_gluon.run
    monkeypatch.setattr(dg._kda_decode_gluon, "run", lambda *a, **kw: (runs.append(1), real(*a, **kw))[1])
    monkeypatch.setattr(dg._launch, "kernels", {})

    def step(seed: int, dtype: torch.dtype, flags: tuple, misaligned: bool = False) -> None:
        x = on_gpu(make1(5, 3, 64, 64, seed=seed, flags=flags), dtype)
        s0 = x["s0"]
        if misaligned:  # the same values one fp32 past a 16-byte boundary
            s0 = torch.empty(s0.numel() + 1, device="cuda")[1:].view_as(s0).copy_(s0)
            assert s0.data_ptr() % 16 != 0
        o, s = call(x, flags, initial_state=s0, output_final_state=True)
        ro, rs = reference1(x, flags)
        assert rel(o.cpu(), ro) <= TOL[dtype] and rel(s.cpu(), rs) <= 1e-5, (seed, dtype, misaligned)

    k3f, other = FLAGS["k3"], FLAGS["unbounded gate"]
    for seed in range(3):
        step(seed, torch.bfloat16, k3f)
    assert len(runs) == 1
    step(3, torch.bfloat16, k3f, misaligned=True)
    step(4, torch.bfloat16, k3f, misaligned=True)
    assert len(runs) == 2
    step(5, torch.float16, k3f)
    step(6, torch.bfloat16, other)
    step(7, torch.float16, k3f)
    step(8, torch.bfloat16, other)
    step(9, torch.bfloat16, k3f)
    assert len(runs) == 4
    # a launch hook (a profiler's) sends every launch through Triton again, and the hook sees it
    seen = []
    hook = lambda meta: seen.append(meta)  # noqa: E731
    chain = triton.knobs.runtime.launch_enter_hook
    chain.add(hook)
    try:
        step(10, torch.bfloat16, k3f)
    finally:
        chain.remove(hook)
    assert len(runs) == 5 and len(seen) == 1
    step(11, torch.bfloat16, k3f)
    assert len(runs) == 5


# ------------------------------------------------------------------------------------------------ CPU


def test_spec_key_separates_what_triton_specialises():
    """``LaunchCache`` keys a launch on ``_spec_key`` of each argument: two arguments Triton specialises
    differently (its native specialiser) must never share a key."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from k3.ops.kda.triton._common import _spec_key

    buf = torch.zeros(64, dtype=torch.float32)
    samples = [buf, buf[1:], buf[4:], buf.half(), buf.half()[1:], buf.half()[8:], buf.bfloat16(), buf.long(),
               buf.to(torch.int32)[2:], True, False, 0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31,
               2**32, 2**40 + 1, -(2**31), -(2**31) - 1, 2**63 - 16, 2**63, 2**64 - 1, 0.5, 1.0, None]
    seen: dict[object, object] = {}
    for a in samples:
        nat = native(BaseBackend, a, False, True, True)
        key = _spec_key(a)
        assert seen.setdefault(key, nat) == nat, (a, key, nat, seen[key])
    with pytest.raises(TypeError):
        _spec_key("x")


def test_dispatch_off_cuda_and_env(monkeypatch):
    """CPU tensors never take the Gluon path; K3_KDA_GLUON must be 0 or 1."""
    q = torch.zeros(2, 1, 2, 16)
    assert not dg.usable(q, 1, False, 2)
    monkeypatch.setenv("K3_KDA_GLUON", "yes")
    with pytest.raises(ValueError, match="K3_KDA_GLUON"):
        common.gluon_enabled()


def test_note_when_gluon_is_unavailable(monkeypatch, capsys):
    """Without Gluon (another Triton release) a dense CUDA step says once on stderr why it takes the fallback."""
    monkeypatch.setattr(common, "HAVE_GLUON", False)
    monkeypatch.setattr(common, "_NOTED", set())
    monkeypatch.setattr(common.triton, "__version__", "3.8.0")
    assert common.gluon_unavailable("decode") and common.gluon_unavailable("decode")
    err = capsys.readouterr().err
    assert err.count("k3: note: Gluon decode needs triton 3.6.x, found 3.8.0: using the Triton fallback") == 1


